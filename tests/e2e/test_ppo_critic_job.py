"""``train_async.py --advantage-estimator ppo``: the tiny count-up job of the README with PPO's critic in
its own trainer group (one rank on its own logical GPU), shortened to one run.

Checks the run's own records: the policy learns, the critic learns (its values explain more of the
returns), the first ``--num-critic-only-steps`` rollouts train the critic alone, and every save of
the policy has the critic's save of the same step beside it (``<save>_critic``). That a critic save
loads back (head, values, lr schedule) is ``tests/integration/test_critic_group.py``'s.
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

from miles_disagg.loop.critic import CRITIC_STATE_FORMAT
from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest, read_complete

REPO = Path(__file__).resolve().parents[2]
STEPS = 16
CRITIC_ONLY = 2


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("ppo_run")
    run_dir = tmp / "run"
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}  # Ray socket paths must be short
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--run-dir", str(run_dir), "--hf-checkpoint", str(tmp / "base-model"),
         "--hf-checkpoint-init", "tiny-qwen3-digits", "--num-rollout", str(STEPS),
         "--advantage-estimator", "ppo", "--normalize-advantages", "--critic-lr", "1e-3",
         "--num-critic-only-steps", str(CRITIC_ONLY), "--save", str(tmp / "save"), "--save-interval", "8"],
        cwd=tmp, capture_output=True, text=True, timeout=scaled(300), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "critic [1]" in result.stderr  # its own bundle, after the trainer's
    return run_dir


def test_the_policy_learns(ppo_run: Path) -> None:
    rewards = [r["rollout/raw_reward"] for r in read_metrics(ppo_run / "metrics.jsonl")]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= 2 * first and last >= first + 0.1, rewards


def test_the_critic_learns(ppo_run: Path) -> None:
    records = read_metrics(ppo_run / "metrics.jsonl")
    explained = [r["critic/explained_variance"] for r in records]
    values = [r["critic/values_mean"] for r in records]
    assert sum(explained[-4:]) / 4 > explained[0] + 0.5, explained  # a fresh head explains nothing
    assert sum(values[-4:]) / 4 > sum(values[:4]) / 4 + 0.1, values  # the values follow the rising returns
    for r in records:
        assert r["critic/value_loss"] > 0 and 0 <= r["critic/value_clipfrac"] <= 1 and r["critic/lr"] == 1e-3


def test_the_first_rollouts_train_the_critic_alone(ppo_run: Path) -> None:
    for step in read_metrics(ppo_run / "train_steps.jsonl"):
        alone = step["rollout_step"] < CRITIC_ONLY
        assert step["critic/actor_trained"] == (0.0 if alone else 1.0)
        assert ("train/pg_loss" in step) != alone and "critic/value_loss" in step


def test_every_policy_save_has_its_critic_save(ppo_run: Path) -> None:
    save = ppo_run.parent / "save"
    critic = ppo_run.parent / "save_critic"
    for step in (8, STEPS):
        policy_meta = read_complete(save / f"iter_{step:07d}")
        critic_meta = read_complete(critic / f"iter_{step:07d}")
        assert policy_meta is not None and critic_meta is not None
        assert critic_meta.state_format == CRITIC_STATE_FORMAT and critic_meta.version == policy_meta.version
        assert any(name.startswith("state/") for name in critic_meta.files)
    assert find_latest(critic)[1].step == STEPS
    assert json.loads((ppo_run / "summary.json").read_text())["reward_last"] > 0
