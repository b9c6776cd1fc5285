"""The two training loops. They read top to bottom like the reference's train.py/train_async.py.

``train_sync``: generate a batch on the current version, train on it, publish, update, repeat.
``train_async``: the rollout manager keeps generating while the trainer consumes completed
groups; at an update boundary the engines prepare the new version while serving and pause
only to activate it. ``--max-weight-staleness`` bounds how old a consumed sample may be.
"""

from __future__ import annotations

import time

from miles_disagg.config.components import RunConfig
from miles_disagg.loop.evaluation import maybe_evaluate
from miles_disagg.loop.job import Job
from miles_disagg.loop.records import BusyMeter, step_record
from miles_disagg.loop.resume import LoopState, find_resume, maybe_save, restore
from miles_disagg.loop.updates import publish, publish_and_update, start_update
from miles_disagg.rollout.manager import load_groups, save_groups
from miles_disagg.tracking import MetricsTracker, status
from miles_disagg.trainer.losses import assign_advantages
from miles_disagg.types import RolloutBatch


def train_async(job: Job, tracker: MetricsTracker, state: LoopState) -> None:
    """Generation never stops; a published version is activated on the engines while the
    trainer already trains on the next batch. A step's record is written once its update
    has finished (so it carries the activation timings and the engines' versions)."""
    cfg = job.config
    version = state.version
    job.rollout.start()
    busy = BusyMeter(job.router_url if cfg.rollout.router == "builtin" else None)
    unlogged = None  # (step, batch, train metrics, update metrics, timings, PendingUpdate | None)
    for step in range(state.step, cfg.rollout.num_rollout):
        start = time.perf_counter()
        batch = job.rollout.take(cfg.rollout.rollout_batch_size, version)
        got_batch = time.perf_counter()
        if cfg.rollout.save_debug_rollout_data:
            save_groups(cfg.rollout.save_debug_rollout_data.format(rollout_id=step), batch.groups, version)
        train_metrics = job.trainer.train(assign_advantages(batch.groups, cfg.train))
        trained = time.perf_counter()
        update_metrics, pending = {}, None
        if (step + 1) % cfg.weights.update_weights_interval == 0:
            _flush(tracker, unlogged)  # one activation at a time: the previous one finishes first
            unlogged = None
            version, update_metrics, pending = _begin_update(job, version)
            job.rollout.set_version(version)
        last = step == cfg.rollout.num_rollout - 1
        maybe_save(job, LoopState(step + 1, version), last=last)
        update_metrics.update(maybe_evaluate(job, step, version, last=last))
        timings = {"perf/wait_rollout_time": got_batch - start, "perf/train_time": trained - got_batch,
                   "perf/step_time": time.perf_counter() - start, "perf/engine_busy_fraction": busy.fraction()}
        _flush(tracker, unlogged)
        unlogged = (step, batch, train_metrics, update_metrics, timings, pending)
    _flush(tracker, unlogged)


def _begin_update(job: Job, version: int):
    if job.config.weights.update_weight_transfer_mode == "broadcast":
        version, metrics = publish_and_update(job, version)
        return version, metrics, None
    version, metrics = publish(job, version)
    return version, metrics, start_update(job, version)


def _flush(tracker: MetricsTracker, unlogged) -> None:
    if unlogged is None:
        return
    step, batch, train_metrics, update_metrics, timings, pending = unlogged
    if pending is not None:
        update_metrics.update(pending.finish())
    _log_step(tracker, step, batch, train_metrics, update_metrics, timings)


def train_sync(job: Job, tracker: MetricsTracker, state: LoopState) -> None:
    cfg = job.config
    version = state.version
    busy = BusyMeter(job.router_url if cfg.rollout.router == "builtin" else None)
    for step in range(state.step, cfg.rollout.num_rollout):
        start = time.perf_counter()
        batch = _rollout_batch(job, step, version)
        got_batch = time.perf_counter()
        train_metrics = {} if cfg.rollout.debug_rollout_only else job.trainer.train(assign_advantages(batch.groups, cfg.train))
        trained = time.perf_counter()
        update_metrics = {}
        if not cfg.rollout.debug_rollout_only and job.engines is not None:
            version, update_metrics = publish_and_update(job, version)
        last = step == cfg.rollout.num_rollout - 1
        if job.trainer is not None:
            maybe_save(job, LoopState(step + 1, version), last=last)
        update_metrics.update(maybe_evaluate(job, step, version, last=last))
        timings = {"perf/rollout_time": got_batch - start, "perf/train_time": trained - got_batch,
                   "perf/step_time": time.perf_counter() - start, "perf/engine_busy_fraction": busy.fraction()}
        _log_step(tracker, step, batch, train_metrics, update_metrics, timings)


def _rollout_batch(job: Job, step: int, version: int) -> RolloutBatch:
    cfg = job.config.rollout
    if cfg.load_debug_rollout_data:
        groups = load_groups(cfg.load_debug_rollout_data.format(rollout_id=step))
        from miles_disagg.rollout.buffer import summarize

        return RolloutBatch(groups, {"rollout/raw_reward": _mean_reward(groups), **summarize(groups, version, 0).metrics()})
    batch = job.rollout.generate(cfg.rollout_batch_size, version)
    if cfg.save_debug_rollout_data:
        save_groups(cfg.save_debug_rollout_data.format(rollout_id=step), batch.groups, version)
    return batch


def _mean_reward(groups) -> float:
    rewards = [s.reward for g in groups for s in g.samples]
    return sum(rewards) / len(rewards) if rewards else 0.0


def _log_step(tracker: MetricsTracker, step: int, batch: RolloutBatch, train_metrics: dict, update_metrics: dict,
              timings: dict) -> None:
    record = tracker.log(step, step_record(train_metrics, batch.metrics, update_metrics, timings, batch.num_samples))
    parts = [f"step {step}", f"reward {record.get('rollout/raw_reward', 0):.3f}",
             f"staleness max {record.get('rollout/staleness_max', 0):.0f}"]
    if "weights/version" in record:
        parts.append(f"v{record['weights/version']} ({record['perf/update_weights_wire_bytes'] / 1024:.0f} KiB, "
                     f"pause {record.get('perf/update_weights_pause_time', 0) * 1e3:.0f} ms)")
    parts.append(f"{timings['perf/step_time']:.2f}s")
    status(" | ".join(parts))


def run(config: RunConfig) -> None:
    """Start the job, run the entry's loop, write the report, stop the job."""
    from miles_disagg.loop.report import write_report

    with_engines = not config.rollout.debug_train_only
    found = find_resume(config)
    job = Job.start(config, with_trainer=not config.rollout.debug_rollout_only, with_engines=with_engines,
                    run_id=found[1].run_id if found else None, data_position=found[1].data_position if found else 0)
    tracker = MetricsTracker(config.tracking.run_dir, use_tensorboard=config.tracking.use_tensorboard,
                             use_wandb=config.tracking.use_wandb, wandb_project=config.tracking.wandb_project,
                             wandb_group=config.tracking.wandb_group,
                             start_step=found[1].step if found else 0)  # each step logged once after --load
    try:
        state = restore(job, found)
        if config.entry == "train_async" and not (config.rollout.debug_rollout_only or config.rollout.debug_train_only):
            train_async(job, tracker, state)
        else:
            train_sync(job, tracker, state)
    finally:
        tracker.close()
        job.stop()
    write_report(config.tracking.run_dir)
