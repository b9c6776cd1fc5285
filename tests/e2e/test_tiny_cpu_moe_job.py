"""``train_async.py --config configs/tiny_cpu_moe.yaml``, shortened: a random tiny Qwen3-MoE (4 experts,
top 2) made on the spot, two built-in engines serving it, one fsdp trainer rank (the native model),
disk-delta updates. Trained as Qwen3-MoE RL is, with GSPO (``--advantage-estimator gspo``: the
sequence-level ratio, steadier than token ratios under changing expert routing) and the engines'
routing replayed (``--use-rollout-routing-replay``). The policy learns count-up as the dense demo
does, the first step is on-policy, and every published version names the experts as the checkpoint
does on disk."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 20

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tiny_moe_run")
    run_dir = tmp / "run"
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu_moe.yaml"),
         "--run-dir", str(run_dir), "--hf-checkpoint", str(tmp / "base-model"),
         "--hf-checkpoint-init", "tiny-qwen3-moe-digits", "--num-rollout", str(STEPS),
         "--advantage-estimator", "gspo", "--use-rollout-routing-replay"],
        cwd=tmp, capture_output=True, text=True, timeout=540, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    assert json.loads((tmp / "base-model" / "config.json").read_text())["model_type"] == "qwen3_moe"
    return run_dir


def test_the_moe_policy_learns_count_up(moe_run: Path) -> None:
    records = read_metrics(moe_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    rewards = [r["rollout/raw_reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 2 * first and last >= first + 0.15, rewards
    assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert records[0]["train/ppo_kl_first_step"] == 0.0  # GSPO's sequence ratio is exactly 1 on-policy
    assert all(r["train/routing_replay_match"] == 1.0 for r in records)  # every token routed as the engine did


def test_versions_are_published_in_the_on_disk_expert_names(moe_run: Path) -> None:
    indexes = sorted((moe_run / "weight-updates").glob("weight_v*/model.safetensors.index.json"))
    assert indexes
    for index in indexes:
        names = set(json.loads(index.read_text())["weight_map"])
        assert any(".mlp.experts." in n and n.endswith(".down_proj.weight") for n in names), index
        assert not any("gate_up_proj" in n for n in names)
