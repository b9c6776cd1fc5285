"""The critic's saves beside the policy's (``loop/critic.py``): written before the policy's (which
commits the step), in ``--critic-save`` (default ``--save`` + ``_critic``); on resume the critic loads
its save of the policy's step from ``--critic-load`` (default ``--load`` + ``_critic``), starts a new
value head when there are no critic saves, and refuses critic saves of other steps only. After a
critic-only step (``--num-critic-only-steps``) the save is the critic's alone, as miles saves."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_disagg.config import load_config
from miles_disagg.loop.critic import CRITIC_STATE_FORMAT, restore_critic, save_critic, saves_policy
from miles_disagg.loop.resume import LoopState, maybe_save
from miles_disagg.trainer.checkpoint import SaveMeta, read_complete
from miles_disagg.types import ConfigError


class FakeGroup:
    """Writes and reads one marker file per save, as the ranks write state/ (order recorded)."""

    def __init__(self, name: str, order: list, world_size: int = 1):
        self.name, self.order, self.world_size, self.loaded = name, order, world_size, None

    def save(self, directory: str, with_hf: bool = False) -> None:
        self.order.append(self.name)
        (Path(directory) / "state").mkdir()
        (Path(directory) / "state" / "marker").write_text(self.name)

    def load(self, directory: str) -> None:
        self.loaded = Path(directory).name


class FakeJob:
    def __init__(self, config, order):
        self.config, self.run_id, self.rollout = config, "run-1", None
        self.trainer, self.critic = FakeGroup("policy", order), FakeGroup("critic", order, world_size=2)


def job_for(tmp_path: Path, *extra: str) -> FakeJob:
    config, _ = load_config(["--advantage-estimator", "ppo", "--train-backend", "fsdp", "--save",
                             str(tmp_path / "save"), "--load", str(tmp_path / "save"), *extra], "train_async")
    return FakeJob(config, [])


def test_the_critic_is_saved_first_beside_the_policy(tmp_path: Path) -> None:
    job = job_for(tmp_path)
    maybe_save(job, LoopState(step=3, version=3), last=True)
    assert job.trainer.order == ["critic", "policy"]  # the policy's save commits the step
    meta = read_complete(tmp_path / "save_critic" / "iter_0000003")
    assert meta is not None and (meta.step, meta.version, meta.world_size) == (3, 3, 2)
    assert meta.state_format == CRITIC_STATE_FORMAT
    assert read_complete(tmp_path / "save" / "iter_0000003") is not None


def test_resume_loads_the_critic_save_of_the_policy_step(tmp_path: Path) -> None:
    job = job_for(tmp_path)
    for step in (2, 4):
        save_critic(job, SaveMeta(step=step, version=step, run_id="run-1", world_size=1, data_position=0))
    restore_critic(job, 2)
    assert job.critic.loaded == "iter_0000002"  # not the newest: the policy's step
    restore_critic(job, None)
    assert job.critic.loaded == "iter_0000004"  # a fresh policy takes the newest there is
    with pytest.raises(ConfigError, match="resumes at step 3, but .* no complete critic save of that step"):
        restore_critic(job, 3)


def test_without_critic_saves_the_critic_starts_fresh(tmp_path: Path) -> None:
    job = job_for(tmp_path, "--critic-load", str(tmp_path / "elsewhere"))
    restore_critic(job, 5)
    assert job.critic.loaded is None
    (tmp_path / "elsewhere").mkdir()
    policy_like = SaveMeta(step=5, version=5, run_id="r", world_size=1, data_position=0, state_format="fsdp/x")
    from miles_disagg.trainer.checkpoint import write_save

    write_save(tmp_path / "elsewhere", policy_like, lambda d: None)
    with pytest.raises(ConfigError, match="not a critic save"):
        restore_critic(job, 5)


def test_a_save_after_a_critic_only_step_is_the_critic_alone(tmp_path: Path) -> None:
    """miles skips the actor's save while ``rollout_id < --num-critic-only-steps``: after steps 0 and 1
    (two critic-only steps, so saves of steps 1 and 2) the critic alone is saved; after step 2 both."""
    job = job_for(tmp_path, "--num-critic-only-steps", "2")
    for next_step in (1, 2):
        maybe_save(job, LoopState(step=next_step, version=0), last=True)
        assert read_complete(tmp_path / "save_critic" / f"iter_{next_step:07d}") is not None
        assert not (tmp_path / "save" / f"iter_{next_step:07d}").exists()
    assert job.trainer.order == ["critic", "critic"]
    maybe_save(job, LoopState(step=3, version=1), last=True)
    assert job.trainer.order[2:] == ["critic", "policy"]
    assert read_complete(tmp_path / "save" / "iter_0000003") is not None
    restore_critic(job, None)  # a resume finding no policy save before step 3 takes the newest critic save
    assert job.critic.loaded == "iter_0000003"


def test_which_saves_hold_the_policy() -> None:
    ppo, _ = load_config(["--advantage-estimator", "ppo", "--train-backend", "fsdp", "--num-critic-only-steps", "3"],
                         "train_async")
    assert [saves_policy(ppo, next_step) for next_step in range(1, 6)] == [False, False, False, True, True]
    grpo, _ = load_config(["--train-backend", "fsdp"], "train_async")
    assert all(saves_policy(grpo, next_step) for next_step in range(1, 4))
    plain_ppo, _ = load_config(["--advantage-estimator", "ppo", "--train-backend", "fsdp"], "train_async")
    assert saves_policy(plain_ppo, 1)
