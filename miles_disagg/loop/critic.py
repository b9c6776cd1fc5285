"""The driver's side of PPO's critic (``--advantage-estimator ppo``): each rollout's training with it,
and its saves beside the policy's.

Per rollout (miles' order): the critic scores the samples (each response token's value), then the
critic trains and - after the first ``--num-critic-only-steps`` rollouts - the policy trains, both on
the same scored samples (the critic's group is started first and waited for last, so on separate
GPUs the two train at once). The rollout's record holds both: the policy's ``train/*`` and the
critic's ``critic/*`` metrics of each optimizer step (the two take the same number of steps).

Saves: the critic's go to ``--critic-save`` (default ``--save`` + ``_critic``), in the same layout
and step numbering as the policy's (``trainer/checkpoint.py``), written just BEFORE the policy's:
the policy's save commits the step, so every step a resume can find has its critic save. A save
after a critic-only step is the critic's alone, as in miles (the policy has not trained: it is still
what the run started from); a resume that finds no policy save then starts the policy afresh and
the critic from its newest save (below). On
resume the critic loads its save of the policy's step from ``--critic-load`` (default ``--load`` +
``_critic``); a policy save with no critic saves beside it (a run that trained without one) gives
the critic a new value head; critic saves of other steps only are an error.
"""

from __future__ import annotations

from pathlib import Path

from miles_disagg.config.critic_rules import critic_load_dir, critic_save_dir, uses_critic
from miles_disagg.trainer.checkpoint import SaveMeta, find_latest, read_complete, save_name, write_save
from miles_disagg.trainer.results import TrainResult
from miles_disagg.tracking import status
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

CRITIC_STATE_FORMAT = "fsdp/critic-torch-distributed-checkpoint"
ACTOR_TRAINED = "critic/actor_trained"


def train_with_critic(job, step: int, samples: list[Sample]) -> TrainResult:
    """One rollout's training of the critic and (past the critic-only steps) the policy."""
    job.critic.score(samples)
    critic_training = job.critic.train(samples)
    actor = job.trainer.train(samples) if step >= job.config.critic.num_critic_only_steps else None
    return merge_results(actor, critic_training.result())


def merge_results(actor: TrainResult | None, critic: TrainResult) -> TrainResult:
    """The rollout's result: step k holds the policy's step k metrics (when it trained) and the critic's."""
    trained = 0.0 if actor is None else 1.0
    actor_steps = actor.steps if actor is not None else [{} for _ in critic.steps]
    if len(actor_steps) != len(critic.steps):
        raise ValueError(f"the policy took {len(actor_steps)} optimizer steps and the critic {len(critic.steps)}")
    steps = [{**a, **c, ACTOR_TRAINED: trained} for a, c in zip(actor_steps, critic.steps)]
    return TrainResult(steps=steps, rollout={**(actor.rollout if actor else {}), **critic.rollout})


def saves_policy(config, next_step: int) -> bool:
    """Whether the save after step ``next_step - 1`` holds the policy: not after a critic-only step
    (miles skips the actor's save while ``rollout_id < --num-critic-only-steps``)."""
    return not uses_critic(config) or next_step - 1 >= config.critic.num_critic_only_steps


def save_critic(job, meta: SaveMeta) -> Path | None:
    """The critic's save of ``meta``'s step into its save directory (None: no critic, or no --save)."""
    directory = critic_save_dir(job.config)
    if job.critic is None or directory is None:
        return None
    critic_meta = SaveMeta(step=meta.step, version=meta.version, run_id=meta.run_id, world_size=job.critic.world_size,
                           data_position=meta.data_position, state_format=CRITIC_STATE_FORMAT)
    return write_save(directory, critic_meta, lambda partial: job.critic.save(str(partial)))


def restore_critic(job, step: int | None) -> None:
    """Load the critic's save of the policy's resumed ``step`` (None: a fresh policy, which takes the
    newest critic save there is, e.g. an explicit ``--critic-load``); see the module docstring."""
    directory = critic_load_dir(job.config)
    if job.critic is None or directory is None:
        return
    found = _critic_save(Path(directory), step)
    if found is None:
        if step is not None:
            status(f"critic: no save in {directory}; a new value head on --hf-checkpoint")
        return
    path, meta = found
    if meta.state_format != CRITIC_STATE_FORMAT:
        raise ConfigError(f"--critic-load {directory}: {path.name} is not a critic save of this launcher "
                          f"(state {meta.state_format or 'unknown'!r})", ("--critic-load",))
    job.critic.load(str(path))
    status(f"critic: resumed from {path} (step {meta.step})")


def _critic_save(directory: Path, step: int | None) -> tuple[Path, SaveMeta] | None:
    if step is None:
        return find_latest(directory)
    path = directory / save_name(step)
    meta = read_complete(path) if path.is_dir() else None
    if meta is not None:
        return path, meta
    newest = find_latest(directory)
    if newest is not None:
        raise ConfigError(f"the policy resumes at step {step}, but {directory} holds no complete critic save of that "
                          f"step (its newest is {newest[0].name}): give --critic-load the critic saves of this run",
                          ("--critic-load", "--load"))
    return None
