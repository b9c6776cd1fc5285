"""Saving and resuming a run without breaking version identity.

On ``--load DIR`` the newest complete save is restored: the model, optimizer and RNG of
every rank, the step, and the data position. The save may have been written by another
number of trainer ranks (or, megatron, another TP/DP layout): the state reshards on load and
the change is logged. The publisher continues the saved run's version stream
from the store's ``LATEST`` (a number is never reused). If the store does not hold exactly the
saved policy as its newest version (it moved on after the save, or lost versions), the trainer
republishes its own state as a ``full`` version with the next number, so every host converges
onto what the trainer really holds. Engines are brought to that version before rollout resumes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from miles_disagg.config.components import RunConfig
from miles_disagg.loop.critic import restore_critic, save_critic, saves_policy
from miles_disagg.tracking import status
from miles_disagg.trainer.checkpoint import (
    STATE_FORMATS, SaveMeta, check_state_format, check_world_size, find_latest, write_save)
from miles_disagg.trainer.torch_dist import initial_checkpoint


@dataclass
class LoopState:
    step: int = 0  # next step to run
    version: int = 0  # the trainer's newest published version


def find_resume(config: RunConfig) -> tuple[Path, SaveMeta] | None:
    if not config.train.load:
        return None
    found = find_latest(config.train.load)
    if found is None:
        start = initial_checkpoint(config.train.load, config.train.ref_load, resuming=False)
        origin = f"{start[1]} {start[0]} (a Megatron torch_dist checkpoint)" if start else "--hf-checkpoint"
        status(f"--load {config.train.load}: no save of this launcher there; starting from {origin}")
        return None
    path, meta = found
    check_state_format(meta, config.train.train_backend, path)
    status(f"resuming from {path} (step {meta.step}, version {meta.version}, run {meta.run_id})")
    change = check_world_size(meta, config.cluster.num_actor_gpus)
    if change:
        status(change)
    return found


def restore(job, found: tuple[Path, SaveMeta] | None) -> LoopState:
    """Load the saved trainer state and reconcile it with the version store and the engines.

    A fresh run whose policy starts from a torch_dist checkpoint (not the engines' base) first
    publishes it as version 1 and brings the engines to it: no sample comes from another policy.
    A PPO critic loads its save of the same step (``loop/critic.py``)."""
    restore_critic(job, found[1].step if found else None)
    if found is None:
        return _publish_initial(job) if job.initial_checkpoint and job.trainer is not None else LoopState()
    path, meta = found
    job.trainer.load(str(path))
    version = meta.version
    if job.config.weights.update_weight_transfer_mode == "disk-delta":
        latest = job.trainer.latest_published()
        store_version = latest["version"] if latest else 0
        version = store_version
        if store_version != meta.version:
            version = job.trainer.publish_full().ref.version
            status(f"store was at v{store_version}, the save holds v{meta.version}: republished the trainer's "
                   f"state as full v{version}")
        if job.engines is not None and version > 0:
            job.engines.update_weights(version)
            status(f"engines at v{version}")
    if job.rollout is not None:
        job.rollout.set_version(version)
    return LoopState(step=meta.step, version=version)


def _publish_initial(job) -> LoopState:
    from miles_disagg.loop.updates import publish, publish_and_update

    path, flag = job.initial_checkpoint
    if job.engines is not None:
        version, _ = publish_and_update(job, 0)
    elif job.config.weights.update_weight_transfer_mode == "disk-delta":
        version, _ = publish(job, 0)  # the rollout service's replicas converge on it themselves
    else:
        return LoopState()
    status(f"the policy starts from {flag} {path}: published as v{version}, the engines serve it")
    if job.rollout is not None:
        job.rollout.set_version(version)
    return LoopState(step=0, version=version)


def maybe_save(job, state: LoopState, *, last: bool) -> None:
    """Save after the step ``state.step - 1`` when the interval says so, and at the end (after a
    critic-only step the critic alone: ``loop/critic.py``)."""
    train = job.config.train
    if not train.save:
        return
    due = train.save_interval and state.step % train.save_interval == 0
    if not (due or last):
        return
    hf_due = last or bool(train.save_hf_interval and state.step % train.save_hf_interval == 0)
    position = job.rollout.data_position() if job.rollout is not None else 0
    meta = SaveMeta(step=state.step, version=state.version, run_id=job.run_id,
                    world_size=job.trainer.world_size, data_position=position,
                    state_format=STATE_FORMATS[train.train_backend])
    critic_path = save_critic(job, meta)  # before the policy's save, which commits the step
    if not saves_policy(job.config, state.step):
        status(f"saved {critic_path} (step {state.step}): the critic alone after a critic-only step, the policy "
               "has not trained")
        return
    path = write_save(train.save, meta, lambda partial: job.trainer.save(str(partial), with_hf=hf_due))
    status(f"saved {path} (step {state.step}, v{state.version}{', with HF export' if hf_due else ''})")
