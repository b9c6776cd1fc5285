"""PPO's critic and on-policy distillation as a user runs them, carried by one pair of runs:
``train_async.py --config configs/tiny_cpu.yaml --advantage-estimator ppo ... --use-opd --opd-type
sglang --opd-teacher-hf-checkpoint DIR``, then the same job resumed with ``--load``.

PPO: the critic is a trainer group of its own (one rank on its own logical GPU). The policy learns,
the critic learns (its values explain more of the returns), the first ``--num-critic-only-steps``
rollouts train the critic alone, and every save of the policy has the critic's save of the same step
beside it (``<save>_critic``); the resumed run loads both from the last save and trains on (the
critic's exact reload: head, values, lr schedule, is ``tests/integration/test_critic_group.py``'s).

OPD: the job serves the teacher (a built-in engine holding the base checkpoint), every training
sample's tokens are scored by it through SGLang's ``/generate`` (``logprob_start_len`` 0,
``max_new_tokens`` 0), and each token's advantage loses ``--opd-kl-coef`` x the reverse KL. The first
run is top-k OPD (``--opd-log-prob-top-k 4 --opd-top-k-strategy union``): the engines answer each
generation call's top-4 per token, the teacher its top-4 and its logprobs of the student's, the
student's engines (through the router) theirs of the teacher's, and the term is taken over the union.
The student learns count-up with the teacher's term, the teacher's logprobs are those of the base
weights (the first step the policy trains on, after the critic-only ones, samples from the base: no
reverse KL) and are attributed to the teacher's version; the resumed run (sampled-token OPD) serves
a teacher again and loads the trained policy (so the reverse KL is far from 0 at once).

The two features were a pair of runs each (``test_ppo_critic_job.py``, ``test_opd_job.py``; about
70 s of the suite's time each): one pair carries both modules' checks. Measured 2026-12-07, the joint
run learns as each did alone (reward 0.04 -> 0.36 and 0.45 by step 16 in two runs, against 0.43 and
0.48 alone; the critic's explained variance -1.9 -> 0.19), and the module took 85 s on the loaded
machine where the two took 95 and 102 s."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from base_model import place_base_model
from deadlines import scaled
from run_flags import ONE_ENGINE

from miles_disagg.loop.critic import CRITIC_STATE_FORMAT
from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest, read_complete

REPO = Path(__file__).resolve().parents[2]
STEPS, RESUMED = 16, 2
CRITIC_ONLY = 2
SAVE_INTERVAL = 8
K = 4
TOP_K = ("--opd-log-prob-top-k", str(K), "--opd-top-k-strategy", "union")  # the first run: top-k OPD
pytestmark = pytest.mark.timeout(600)  # two runs in the module fixture


def train_async(tmp: Path, num_rollout: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}  # Ray socket paths must be short
    base = str(tmp / "base-model")
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--run-dir", str(tmp / "run"), "--hf-checkpoint", base, "--num-rollout", str(num_rollout),
         "--advantage-estimator", "ppo", "--normalize-advantages", "--critic-lr", "1e-3",
         "--num-critic-only-steps", str(CRITIC_ONLY),
         "--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "0.1", "--opd-teacher-hf-checkpoint", base,
         "--save", str(tmp / "saves"), "--save-interval", str(SAVE_INTERVAL),
         "--save-debug-rollout-data", str(tmp / "consumed" / "{rollout_id}.jsonl"), *ONE_ENGINE, *extra],
        cwd=tmp, capture_output=True, text=True, timeout=scaled(300), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path):
    """(tmp, the first run, its records, the resumed run)."""
    tmp = tmp_path_factory.mktemp("ppo_opd")
    place_base_model(digits_base_model, tmp)
    first = train_async(tmp, STEPS, *TOP_K)
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    resumed = train_async(tmp, STEPS + RESUMED, "--load", str(tmp / "saves"))
    return tmp, first, records, resumed


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_the_policy_learns_with_the_teachers_term(runs) -> None:
    _, first, records, _ = runs
    assert "critic [1]" in first.stderr  # its own bundle, after the trainer's
    assert "OPD teacher: http://127.0.0.1:" in first.stderr and "(weight_version 0)" in first.stderr
    assert [r["step"] for r in records] == list(range(STEPS))
    rewards = [r["rollout/raw_reward"] for r in records]
    for window in (4, 5):
        start, end = mean(rewards[:window]), mean(rewards[-window:])
        assert end >= 2 * start and end >= start + 0.1, rewards
    # the critic-only rollouts train no policy (no reverse KL taken); the first one the policy trains
    # on samples from the base weights, which are the teacher's
    assert all("train/opd_reverse_kl" not in r for r in records[:CRITIC_ONLY])
    kls = [r["train/opd_reverse_kl"] for r in records[CRITIC_ONLY:]]
    assert abs(kls[0]) < 1e-3, kls
    assert mean(kls[-5:]) > 0.05, kls  # the student has moved away from its teacher


def test_the_critic_learns(runs) -> None:
    records = runs[2]
    explained = [r["critic/explained_variance"] for r in records]
    values = [r["critic/values_mean"] for r in records]
    assert mean(explained[-4:]) > explained[0] + 0.5, explained  # a fresh head explains nothing
    assert mean(values[-4:]) > mean(values[:4]) + 0.1, values  # the values follow the rising returns
    for r in records:
        assert r["critic/value_loss"] > 0 and 0 <= r["critic/value_clipfrac"] <= 1 and r["critic/lr"] == 1e-3


def test_the_first_rollouts_train_the_critic_alone(runs) -> None:
    for step in read_metrics(runs[0] / "run" / "train_steps.jsonl"):
        alone = step["rollout_step"] < CRITIC_ONLY
        assert step["critic/actor_trained"] == (0.0 if alone else 1.0)
        assert ("train/pg_loss" in step) != alone and "critic/value_loss" in step


def test_every_policy_save_has_its_critic_save(runs) -> None:
    save, critic = runs[0] / "saves", runs[0] / "saves_critic"
    for step in (SAVE_INTERVAL, STEPS):
        policy_meta = read_complete(save / f"iter_{step:07d}")
        critic_meta = read_complete(critic / f"iter_{step:07d}")
        assert policy_meta is not None and critic_meta is not None
        assert critic_meta.state_format == CRITIC_STATE_FORMAT and critic_meta.version == policy_meta.version
        assert any(name.startswith("state/") for name in critic_meta.files)
    assert find_latest(critic)[1].step >= STEPS


def test_every_sample_is_scored_by_the_teacher_and_attributed_to_its_version(runs) -> None:
    tmp = runs[0]
    for step in (0, STEPS - 1):
        for line in (tmp / "consumed" / f"{step}.jsonl").read_text().splitlines():
            for sample in json.loads(line)["samples"]:
                assert sample["teacher_version"] == "0"
                assert len(sample["teacher_logprobs"]) == len(sample["response_ids"]) > 0
                # top-k: the student's top-K of every response token, and each token's term over the union
                assert [len(row) for row in sample["metadata"]["opd_student_top_logprobs"]] == \
                    [K] * len(sample["response_ids"])
                assert len(sample["opd_reverse_kl"]) == len(sample["response_ids"])
                if step == 0 and sample["weight_version_end"] == 0:  # generated by the base weights, at T = 1
                    assert sample["teacher_logprobs"] == pytest.approx(sample["response_logprobs"], abs=1e-3)
                    assert sample["opd_reverse_kl"] == pytest.approx([0.0] * len(sample["response_ids"]), abs=1e-3)


def test_a_resumed_run_loads_the_policy_and_the_critic_serves_its_teacher_again_and_trains_on(runs) -> None:
    tmp, _, records, resumed = runs
    save, run_dir = tmp / "saves", tmp / "run"
    assert f"resuming from {save}" in resumed.stderr and "OPD teacher: http://" in resumed.stderr
    assert f"critic: resumed from {save}_critic/iter_{STEPS:07d} (step {STEPS})" in resumed.stderr
    after = read_metrics(run_dir / "metrics.jsonl")[len(records):]
    assert [r["step"] for r in after] == list(range(STEPS, STEPS + RESUMED))
    assert after[0]["weights/version"] == records[-1]["weights/version"] + 1  # the same run's version stream
    rewards = [r["rollout/raw_reward"] for r in records]
    for window in (4, 5):  # the trained policy, not the base
        assert min(r["rollout/raw_reward"] for r in after) > mean(rewards[:window]) + 0.1, after
    assert after[0]["train/opd_reverse_kl"] > 0.05  # ... which the teacher (the base) disagrees with
    assert after[0]["train/train_rollout_logprob_abs_diff"] < 1e-3  # the engines serve the loaded policy
    # the loaded critic, not a fresh head (which explains nothing of the returns)
    assert after[0]["critic/explained_variance"] > records[0]["critic/explained_variance"] + 0.3, after
    resumed_steps = [r for r in read_metrics(run_dir / "train_steps.jsonl") if r["rollout_step"] >= STEPS]
    assert resumed_steps and all("train/pg_loss" in r for r in resumed_steps)  # the policy trains from the start
    assert find_latest(tmp / "saves_critic")[1].step == STEPS + RESUMED  # saved at the run's end
    assert json.loads((run_dir / "summary.json").read_text())["reward_last"] > 0
