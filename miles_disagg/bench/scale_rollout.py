"""``bench scale``'s rollout section: the rollout manager producing through each pool's router.

The manager (:class:`~miles_disagg.rollout.manager.RolloutManager`, in this process, the built-in count-up
task on a digits tokenizer) keeps ``--rollout-concurrency`` requests in flight whatever the pool size; the
trainer's side takes batches of 64 groups for ``--duration`` seconds. ``--rounds`` windows per pool size,
the sizes taking turns (a change of the machine's load hits every size alike), each through a router
started for it (the router section's, with the first ``--router-workers`` count).
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


class RolloutRuns:
    """Every rollout window of every pool size."""

    def __init__(self, root: Path):
        self.tokenizer = tokenizer_dir(root)
        self.runs: dict[int, list[float]] = {}
        self.samples: dict[int, int] = {}

    def measure(self, size: int, router_url: str, command: Any) -> None:
        produced, elapsed = asyncio.run(drive_rollout_manager(self.tokenizer, router_url, command))
        self.runs.setdefault(size, []).append(round(produced / elapsed, 1))
        self.samples[size] = self.samples.get(size, 0) + produced
        _progress(f"  rollout manager, {size} engines: {self.runs[size][-1]} samples/s")

    def results(self, command: Any) -> dict[int, dict]:
        """Per pool size: median samples/s over its windows, each window's, and this process's memory."""
        return {size: {"samples_per_s": round(statistics.median(runs), 1), "samples_per_s_per_round": runs,
                       "samples": self.samples[size], "rollout_concurrency": command.rollout_concurrency,
                       "manager_process_rss_mb": rss_mb(os.getpid())} for size, runs in self.runs.items()}


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
