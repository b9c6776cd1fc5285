"""A tiny Qwen3-MoE (4 experts, top 2) trains with ``train_async.py`` on CPU: Megatron with expert
parallelism 2 over 2 trainer ranks (gloo, all-to-all dispatcher), two built-in engines, disk-delta
updates, the count-up task (``configs/tiny_cpu.yaml`` with the backend and model changed).

Needs the other parts of the MoE work: the built-in engine loading versions published under the
on-disk per-expert names (it runs transformers' model, whose experts are fused in memory) and
the rollout returning routed experts. Without them the test is an expected failure naming
what is missing (checked from the run's own output), never a pass.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = 12

pytest.importorskip("megatron.core", reason="megatron-core is not installed")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET
    from tiny_moe import make_tiny_moe

    tmp = tmp_path_factory.mktemp("tiny_moe_run")
    base = make_tiny_moe(tmp / "base-moe", seed=1234, charset=DIGITS_CHARSET, std=0.02)
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(base), "--hf-checkpoint-init", "none",
         "--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--expert-model-parallel-size", "2",
         "--use-rollout-routing-replay", "--num-rollout", str(STEPS)],
        cwd=tmp, capture_output=True, text=True, timeout=900, env=env)
    return tmp / "run", result


@pytest.mark.timeout(1000)
def test_tiny_moe_trains_with_megatron_ep2_through_builtin_engines(moe_run) -> None:
    run_dir, result = moe_run
    if result.returncode != 0 and "mlp.experts.gate_up_proj" in result.stderr:
        pytest.xfail("the built-in engine expects transformers' fused expert names, not the on-disk ones the "
                     "trainer publishes (needs the built-in engine's MoE support)")
    assert result.returncode == 0, result.stderr[-6000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    if "train/routing_replay_match" not in records[0]:
        pytest.xfail("samples carry no rollout_routed_experts (needs the rollout's routed-experts plumbing)")
    for r in records:
        assert r["train/routing_replay_match"] == 1.0  # the trainer used the engines' experts
    assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    rewards = [r["rollout/raw_reward"] for r in records]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first, rewards  # reward climbs as the dense demo's does
