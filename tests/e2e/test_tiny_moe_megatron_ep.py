"""A tiny Qwen3-MoE (4 experts, top 2) trains with ``train_async.py`` on CPU: Megatron with expert
parallelism 2 over 2 trainer ranks (gloo, all-to-all dispatcher), a built-in engine, disk-delta
updates, the count-up task (``configs/tiny_cpu_moe.yaml`` with the backend changed), trained as
Qwen3-MoE RL is, with GSPO (``--advantage-estimator gspo``). With routing replay on: the engines
return each token's routed experts, the trainer replays them (``train/routing_replay_match`` 1.0
every step) and its step-0 logprobs equal the engines'; every published version names the experts
as the checkpoint does on disk.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from deadlines import scaled
from run_flags import ONE_ENGINE

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 20

pytest.importorskip("megatron.core", reason="megatron-core is not installed")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    tmp = tmp_path_factory.mktemp("tiny_moe_run")
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu_moe.yaml"),
         "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
         "--hf-checkpoint-init", "tiny-qwen3-moe-digits",
         "--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2",
         "--use-rollout-routing-replay", "--advantage-estimator", "gspo", "--num-rollout", str(STEPS),
         *ONE_ENGINE],
        cwd=tmp, capture_output=True, text=True, timeout=scaled(900), env=env)
    return tmp / "run", result


@pytest.mark.timeout(1000)
def test_tiny_moe_trains_with_megatron_ep2_through_builtin_engines(moe_run) -> None:
    run_dir, result = moe_run
    assert result.returncode == 0, result.stderr[-6000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    for r in records:
        assert r["train/routing_replay_match"] == 1.0  # the trainer used the engines' experts
    assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert records[0]["train/ppo_kl_first_step"] == 0.0  # GSPO's sequence ratio is exactly 1 on-policy
    rewards = [r["rollout/raw_reward"] for r in records]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert last >= 2 * first and last >= first + 0.15, rewards
    indexes = sorted((run_dir / "weight-updates").glob("weight_v*/model.safetensors.index.json"))
    assert indexes
    for index in indexes:
        names = set(json.loads(index.read_text())["weight_map"])
        assert any(".mlp.experts." in n and n.endswith(".down_proj.weight") for n in names), index
        assert not any("gate_up_proj" in n for n in names)
