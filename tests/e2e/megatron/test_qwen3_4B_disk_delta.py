"""The 8-GPU Qwen3-4B disk-delta run: a megatron trainer (TP 2 + sequence parallel, CP 2, full
recomputation, dynamic batches) on 4 GPUs and two SGLang engines (TP 2) on the other 4, through
``train_async.py`` with ``--update-weight-transfer-mode disk-delta``.

It runs ``scripts/run_qwen3_4B_disk_delta.sh`` (the same run by hand) and checks that after each
update both engines serve the trainer's version, that each version was published with its
density and wire bytes logged, that the first step is on-policy (``ppo_kl`` ~ 0) and that the
trainer's and the engines' logprobs of the sampled tokens agree.

Skipped, with the reason, unless 8 CUDA GPUs, sglang, megatron-core with Transformer Engine
(context parallelism needs it) and the local model and data are present:

- ``MILES_DISAGG_QWEN3_4B_DIR``: a local Qwen3-4B HF checkpoint directory.
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
SCRIPT = REPO / "scripts" / "run_qwen3_4B_disk_delta.sh"
MODEL_ENV, DATA_ENV = "MILES_DISAGG_QWEN3_4B_DIR", "MILES_DISAGG_DAPO_MATH_JSONL"
NUM_GPUS = 8
NUM_ROLLOUT = 2
# bf16 trainer vs bf16 SGLang on the same weights: kernel differences only.
MAX_TRAIN_ROLLOUT_LOGPROB_ABS_DIFF = 0.1


def missing_requirement() -> str | None:
    """Why this machine cannot run the test, or None."""
    import torch

    if torch.cuda.device_count() < NUM_GPUS:
        return f"needs {NUM_GPUS} CUDA GPUs (found {torch.cuda.device_count()})"
    for module, why in (("sglang", "sglang (the rollout engines)"), ("megatron.core", "megatron-core (the trainer)"),
                        ("transformer_engine", "Transformer Engine (context parallelism)")):
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            return f"needs {why}: `{module}` is not importable"
    model, data = os.environ.get(MODEL_ENV), os.environ.get(DATA_ENV)
    if not model or not (Path(model) / "config.json").is_file():
        return f"needs {MODEL_ENV} set to a local Qwen3-4B checkpoint directory (got {model!r})"
    if not data or not Path(data).is_file():
        return f"needs {DATA_ENV} set to a dapo-math style JSONL file (got {data!r})"
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.slow, pytest.mark.timeout(2400)]


def test_qwen3_4B_megatron_disk_delta(tmp_path: Path) -> None:
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
        cwd=REPO, capture_output=True, text=True, timeout=2300, env=env)
    assert result.returncode == 0, result.stderr[-8000:]

    records = join_updates(read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "updates.jsonl"))
    assert [r["step"] for r in records] == list(range(NUM_ROLLOUT))
    for r in records:
        version = r["step"] + 1
        assert r["weights/version"] == version
        assert r["weights/engine_versions"] == [str(version)] * 2  # both engines activated it
        assert 0 < r["perf/update_weights_density"] <= 1
        assert r["perf/update_weights_wire_bytes"] > 0
        assert r["train/train_rollout_logprob_abs_diff"] < MAX_TRAIN_ROLLOUT_LOGPROB_ABS_DIFF
    assert (publish_dir / f"weight_v{NUM_ROLLOUT:06d}").is_dir()
    assert any(local_dir.rglob("*.safetensors"))  # the host-local checkpoint was materialized
    # The trainer recomputes the behaviour logprobs with the weights it then trains: ratio 1.
    assert abs(records[0]["train/ppo_kl_first_step"]) < 1e-3
    assert records[0]["train/pg_clipfrac_first_step"] < 1e-3
