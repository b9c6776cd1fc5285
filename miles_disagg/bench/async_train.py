"""``miles-disagg bench async``: the same tiny workload through train.py and train_async.py.

Both runs use the tiny CPU config (one trainer rank, built-in engines on logical GPUs,
disk-delta updates, staleness bound 2) with the same prompts, batch and steps; each runs as
a subprocess, as a user would start it. Defaults fit a 2-core machine: one engine (one core
generating, one training), a random Qwen3 of hidden size 128 and 32-token responses, so that
generation and training cost about the same, as in real RL. Throughput is samples trained per second of step time, excluding the
first ``--warmup-steps`` steps (start-up, first update). ``engine_busy_fraction`` is the
router's measure of how much of the wall time each engine had a request in flight, under
train_async, over the same steps. Prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.common import progress, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag
from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]


@dataclass(kw_only=True)
class AsyncBench:
    """train.py vs train_async.py throughput and engine busy fraction"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    config: Path = flag(REPO / "configs" / "tiny_cpu.yaml", "YAML config of both runs.")
    steps: int = flag(12, "Steps of each run.")
    warmup_steps: int = flag(3, "First steps left out of the measurement.")
    response_len: int = flag(32, "--rollout-max-response-len of both runs.")
    engines: int = flag(1, "Built-in engines of both runs (--rollout-num-gpus).")
    hidden_size: int = flag(128, "Of the random digits-vocabulary Qwen3 both runs train.")
    num_layers: int = flag(2, "Of the random Qwen3.")
    work_dir: Path | None = flag(None, "Keep both run directories here (default: a temp dir).")
    extra: list[str] = flag([], "More flags for both runs, after --.", positional=True)

    def __post_init__(self) -> None:
        if self.steps <= self.warmup_steps:
            raise ValueError(f"--steps {self.steps} must exceed --warmup-steps {self.warmup_steps}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, AsyncBench)


_progress = progress("async")


def run(args: argparse.Namespace) -> int:
    command = config_from_args(AsyncBench, args)
    with work_dir("async", command.work_dir) as root:
        _make_model(root / "base-model", command)
        sync = _measure("train", root, command)
        async_ = _measure("train_async", root, command)
    result = {
        "samples_per_s_sync": sync["samples_per_s"],
        "samples_per_s_async": async_["samples_per_s"],
        "ratio": async_["samples_per_s"] / sync["samples_per_s"],
        "engine_busy_fraction": async_["engine_busy_fraction"],
        "engine_busy_fraction_sync": sync["engine_busy_fraction"],
        "steps_measured": command.steps - command.warmup_steps,
        "samples_per_step": sync["samples_per_step"],
        "reward_last_async": async_["reward_last"],
        "reward_last_sync": sync["reward_last"],
        "staleness_max_async": async_["staleness_max"],
    }
    print(json.dumps(result))
    return 0


def _make_model(path: Path, command: AsyncBench) -> None:
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET, make_tiny_qwen3

    if not path.exists():
        _progress(f"writing a random Qwen3 (hidden {command.hidden_size}, {command.num_layers} layers, digits vocabulary)")
        make_tiny_qwen3(path, hidden_size=command.hidden_size, intermediate_size=2 * command.hidden_size,
                        num_hidden_layers=command.num_layers, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=command.hidden_size // 4, charset=DIGITS_CHARSET)


def _measure(entry: str, root: Path, command: AsyncBench) -> dict:
    run_dir = root / entry
    extra = [a for a in command.extra if a != "--"]
    cmd = [sys.executable, str(REPO / f"{entry}.py"), "--config", str(command.config), "--run-dir", str(run_dir),
           "--hf-checkpoint", str(root / "base-model"), "--num-rollout", str(command.steps),
           "--rollout-max-response-len", str(command.response_len), "--rollout-num-gpus", str(command.engines),
           # the base model is this bench's own (hidden size --hidden-size), not the config's --hf-checkpoint-init one
           "--hf-checkpoint-init", "none", *extra]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}
    _progress(f"{entry}.py: {command.steps} steps")
    result = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{entry}.py exited {result.returncode}:\n{result.stderr[-4000:]}")
    records = read_metrics(run_dir / "metrics.jsonl")[command.warmup_steps:]
    samples = sum(r["perf/samples_per_s"] * r["perf/step_time"] for r in records)
    seconds = sum(r["perf/step_time"] for r in records)
    busy = [r["perf/engine_busy_fraction"] * r["perf/step_time"] for r in records
            if r.get("perf/engine_busy_fraction") is not None]
    return {"samples_per_s": samples / seconds, "engine_busy_fraction": sum(busy) / seconds,
            "samples_per_step": round(samples / len(records)),
            "reward_last": sum(r["rollout/raw_reward"] for r in records[-5:]) / len(records[-5:]),
            "staleness_max": max(r.get("rollout/staleness_max", 0) for r in records)}
