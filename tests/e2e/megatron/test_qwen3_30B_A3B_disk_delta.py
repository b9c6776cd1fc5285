"""The 16-GPU Qwen3-30B-A3B (MoE) disk-delta run: a megatron trainer (TP 4 + sequence parallel,
EP 8, expert TP 1, full recomputation, dynamic batches) on 8 GPUs and one SGLang engine (TP 8,
EP 8, DP attention) on the other 8, through ``train_async.py`` with disk-delta updates and
rollout routing replay.

It runs ``scripts/run_qwen3_30B_A3B_disk_delta.sh`` and checks that each update reaches the
engine, that replay made the trainer use the engine's experts for every trained token, and
that the first step's train-vs-rollout logprob difference is small.

Skipped, with the reason, unless 16 CUDA GPUs, sglang, megatron-core with Transformer Engine
(sequence parallelism, grouped-GEMM experts) and the local model and data are present:

- ``MILES_DISAGG_QWEN3_30B_A3B_DIR``: a local Qwen3-30B-A3B HF checkpoint directory.
- ``MILES_DISAGG_DAPO_MATH_JSONL``: dapo-math-17k style JSONL (``prompt`` messages, ``label``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "run_qwen3_30B_A3B_disk_delta.sh"
MODEL_ENV, DATA_ENV = "MILES_DISAGG_QWEN3_30B_A3B_DIR", "MILES_DISAGG_DAPO_MATH_JSONL"
NUM_GPUS = 16
NUM_ROLLOUT = 2
MAX_TRAIN_ROLLOUT_LOGPROB_ABS_DIFF = 0.1  # bf16 trainer vs bf16 SGLang, routing replayed


def missing_requirement() -> str | None:
    """Why this machine cannot run the test, or None."""
    import torch

    if torch.cuda.device_count() < NUM_GPUS:
        return f"needs {NUM_GPUS} CUDA GPUs (found {torch.cuda.device_count()})"
    for module, why in (("sglang", "sglang (the rollout engine)"), ("megatron.core", "megatron-core (the trainer)"),
                        ("transformer_engine", "Transformer Engine (sequence parallelism, grouped-GEMM experts)")):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            return f"needs {why}: `{module}` is not importable"
    model, data = os.environ.get(MODEL_ENV), os.environ.get(DATA_ENV)
    if not model or not (Path(model) / "config.json").is_file():
        return f"needs {MODEL_ENV} set to a local Qwen3-30B-A3B checkpoint directory (got {model!r})"
    if not data or not Path(data).is_file():
        return f"needs {DATA_ENV} set to a dapo-math style JSONL file (got {data!r})"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(5400)]


def test_qwen3_30B_A3B_megatron_ep_disk_delta(tmp_path: Path) -> None:
    reason = missing_requirement()
    if reason:
        pytest.skip(reason)
    from miles_disagg.loop.report import join_updates
    from miles_disagg.tracking import read_metrics

    run_dir, publish_dir, local_dir = tmp_path / "run", tmp_path / "weight-updates", tmp_path / "local-checkpoint"
    env = {**os.environ, "PYTHON": sys.executable, "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled")}
    result = subprocess.run(
        ["bash", str(SCRIPT), "--run-dir", str(run_dir), "--update-weight-disk-dir", str(publish_dir),
         "--update-weight-local-checkpoint-dir", str(local_dir)],
        cwd=REPO, capture_output=True, text=True, timeout=5300, env=env)
    assert result.returncode == 0, result.stderr[-8000:]

    records = join_updates(read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "updates.jsonl"))
    assert [r["step"] for r in records] == list(range(NUM_ROLLOUT))
    for r in records:
        assert r["weights/version"] == r["step"] + 1
        assert r["weights/engine_versions"] == [str(r["step"] + 1)]
        assert r["train/routing_replay_match"] == 1.0
        assert 0 < r["perf/update_weights_density"] <= 1
    assert records[0]["train/train_rollout_logprob_abs_diff"] < MAX_TRAIN_ROLLOUT_LOGPROB_ABS_DIFF
