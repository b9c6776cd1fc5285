"""``train_async.py --advantage-estimator ppo``: the tiny count-up job of the README with PPO's critic in
its own trainer group (one rank on its own logical GPU), shortened to one run.

Checks the run's own records: the policy learns, the critic learns (its values explain more of the
returns), the first ``--num-critic-only-steps`` rollouts train the critic alone, and every save of
the policy has the critic's save of the same step beside it (``<save>_critic``); a second run with ``--load``
resumes both from the last save and trains on (the critic's exact reload: head, values, lr schedule, is
``tests/integration/test_critic_group.py``'s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from run_flags import ONE_ENGINE
from deadlines import scaled

from miles_disagg.loop.critic import CRITIC_STATE_FORMAT
from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest, read_complete

REPO = Path(__file__).resolve().parents[2]
STEPS, RESUMED = 16, 2
CRITIC_ONLY = 2
pytestmark = pytest.mark.timeout(600)  # two runs in the module fixture


def train_async(tmp: Path, num_rollout: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}  # Ray socket paths must be short
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
         "--hf-checkpoint-init", "tiny-qwen3-digits", "--num-rollout", str(num_rollout),
         "--advantage-estimator", "ppo", "--normalize-advantages", "--critic-lr", "1e-3",
         "--num-critic-only-steps", str(CRITIC_ONLY), "--save", str(tmp / "save"), "--save-interval", "8",
         *ONE_ENGINE, *extra],
        cwd=tmp, capture_output=True, text=True, timeout=scaled(300), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def ppo_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], subprocess.CompletedProcess]:
    """(the run directory, the first run's records, the resumed run)."""
    tmp = tmp_path_factory.mktemp("ppo_run")
    first = train_async(tmp, STEPS)
    assert "critic [1]" in first.stderr  # its own bundle, after the trainer's
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    resumed = train_async(tmp, STEPS + RESUMED, "--load", str(tmp / "save"))
    return tmp / "run", records, resumed


@pytest.fixture(scope="module")
def ppo_run(ppo_runs) -> Path:
    return ppo_runs[0]


def test_the_policy_learns(ppo_runs) -> None:
    rewards = [r["rollout/raw_reward"] for r in ppo_runs[1]]
    assert len(rewards) == STEPS
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= 2 * first and last >= first + 0.1, rewards


def test_the_critic_learns(ppo_runs) -> None:
    records = ppo_runs[1]
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
    assert find_latest(critic)[1].step >= STEPS


def test_a_resumed_run_loads_the_policy_and_the_critic_and_trains_on(ppo_runs) -> None:
    run_dir, records, resumed = ppo_runs
    save = run_dir.parent / "save"
    assert f"resuming from {save}" in resumed.stderr
    assert f"critic: resumed from {save}_critic/iter_{STEPS:07d} (step {STEPS})" in resumed.stderr
    after = read_metrics(run_dir / "metrics.jsonl")[len(records):]
    assert [r["step"] for r in after] == list(range(STEPS, STEPS + RESUMED))
    assert after[0]["weights/version"] == records[-1]["weights/version"] + 1  # the same run's version stream
    first_four = sum(r["rollout/raw_reward"] for r in records[:4]) / 4
    assert min(r["rollout/raw_reward"] for r in after) > first_four + 0.1  # the trained policy, not the base
    # the loaded critic, not a fresh head (which explains nothing of the returns)
    assert after[0]["critic/explained_variance"] > records[0]["critic/explained_variance"] + 0.3, after
    resumed_steps = [r for r in read_metrics(run_dir / "train_steps.jsonl") if r["rollout_step"] >= STEPS]
    assert resumed_steps and all("train/pg_loss" in r for r in resumed_steps)  # the policy trains from the start
    assert find_latest(run_dir.parent / "save_critic")[1].step == STEPS + RESUMED  # saved at the run's end
    assert json.loads((run_dir / "summary.json").read_text())["reward_last"] > 0
