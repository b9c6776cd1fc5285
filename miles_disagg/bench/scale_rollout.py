"""``bench scale``'s rollout section: the rollout manager producing through each pool's router.

The manager (:class:`~miles_disagg.rollout.manager.RolloutManager`, in this process, the built-in count-up
task on a digits tokenizer) keeps ``--rollout-concurrency`` requests in flight whatever the pool size; the
trainer's side takes batches of 64 groups for ``--duration`` seconds. ``--rounds`` windows per pool size,
the sizes taking turns (a change of the machine's load hits every size alike).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from pathlib import Path
from typing import Any

from miles_disagg.bench.common import progress
from miles_disagg.bench.processes import rss_mb

_progress = progress("scale")
GROUPS_PER_BATCH, SAMPLES_PER_PROMPT = 64, 4


def rollout_all(root: Path, router_urls: dict[int, str], command: Any) -> dict[int, dict]:
    """Per pool size: median samples/s over its windows, each window's, and this process's memory."""
    tokenizer = tokenizer_dir(root)
    runs: dict[int, list[float]] = {size: [] for size in router_urls}
    samples: dict[int, int] = {size: 0 for size in router_urls}
    for round_index in range(command.rounds):
        for size, url in router_urls.items():
            produced, elapsed = asyncio.run(drive_rollout_manager(tokenizer, url, command))
            runs[size].append(round(produced / elapsed, 1))
            samples[size] += produced
            _progress(f"  rollout manager, {size} engines, round {round_index + 1}: {runs[size][-1]} samples/s")
    return {size: {"samples_per_s": round(statistics.median(runs[size]), 1), "samples_per_s_per_round": runs[size],
                   "samples": samples[size], "rollout_concurrency": command.rollout_concurrency,
                   "manager_process_rss_mb": rss_mb(os.getpid())} for size in router_urls}


def tokenizer_dir(root: Path) -> Path:
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET, build_tokenizer

    path = root / "tokenizer"
    if not path.exists():
        build_tokenizer(DIGITS_CHARSET).save_pretrained(path)
    return path


async def drive_rollout_manager(tokenizer: Path, router_url: str, command: Any) -> tuple[int, float]:
    """Samples taken, and the seconds they took (after one batch of warm-up)."""
    from miles_disagg.config.actors import RolloutManagerConfig
    from miles_disagg.config.components import RolloutConfig
    from miles_disagg.rollout.manager import RolloutManager

    config = RolloutConfig(rollout_batch_size=GROUPS_PER_BATCH, n_samples_per_prompt=SAMPLES_PER_PROMPT,
                           rollout_max_response_len=16, rollout_concurrency=command.rollout_concurrency,
                           max_weight_staleness=4)
    manager = RolloutManager(RolloutManagerConfig(rollout=config, router_url=router_url, hf_dir=str(tokenizer)),
                             capacity_groups=4 * GROUPS_PER_BATCH)
    await manager.start()
    try:
        await manager.take(GROUPS_PER_BATCH, 0)  # warm-up
        produced, started = 0, time.perf_counter()
        while time.perf_counter() - started < command.duration:
            produced += (await manager.take(GROUPS_PER_BATCH, 0)).num_samples
        return produced, time.perf_counter() - started
    finally:
        await manager.stop()
