"""``train_async.py --train-backend megatron`` on CPU: the tiny run with a TP=2 trainer publishes
disk-delta versions that both built-in engines activate, step after step."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'miles-disagg[megatron]')")

from base_model import place_base_model  # noqa: E402

from miles_disagg.loop.report import join_updates  # noqa: E402
from miles_disagg.tracking import read_metrics  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.timeout(300)
def test_tp2_megatron_trainer_publishes_versions_the_engines_activate(tmp_path: Path, digits_base_model: Path) -> None:
    place_base_model(digits_base_model, tmp_path)
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}  # Ray socket paths must be short
    run_dir = tmp_path / "megatron-tp2"
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--num-rollout", "3", "--rollout-batch-size", "8", "--global-batch-size", "32",
         "--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
         "--run-dir", str(run_dir), "--hf-checkpoint", str(tmp_path / "base-model")],
        cwd=tmp_path, capture_output=True, text=True, timeout=280, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    records = join_updates(read_metrics(run_dir / "metrics.jsonl"), read_metrics(run_dir / "updates.jsonl"))
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        version = r["step"] + 1
        assert r["weights/version"] == version
        assert r["weights/engine_versions"] == [str(version)] * 2
        assert 0 < r["perf/update_weights_density"] <= 1
    # The first step trains on samples of version 0, which the engines and the trainer agree on.
    assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert records[0]["train/ppo_kl_first_step"] == pytest.approx(0.0, abs=1e-6)
    published = sorted(p.name for p in (run_dir / "weight-updates").glob("weight_v*"))
    assert "weight_v000003" in published  # the newest version was published (older ones may be pruned)
    assert all(r["perf/update_weights_wire_bytes"] > 0 for r in records)
