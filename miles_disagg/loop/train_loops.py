"""The two training loops. They read top to bottom like the reference's train.py/train_async.py.

``train_sync``: generate a batch on the current version, train on it, publish, update, repeat
(a step's record includes its update: the step is done once every engine serves the version).
``train_async``: the rollout manager keeps generating while the trainer consumes completed
groups; at an update boundary the engines prepare the new version while serving and pause
only to activate it. ``--max-weight-staleness`` bounds how old a consumed sample may be.
"""

from __future__ import annotations

import time

from miles_disagg.config.components import RunConfig
from miles_disagg.loop.ci_gates import check_step
from miles_disagg.loop.critic import train_with_critic
from miles_disagg.loop.evaluation import maybe_evaluate
from miles_disagg.loop.job import Job
from miles_disagg.loop.records import BusyMeter, open_tracker, step_record
from miles_disagg.loop.resume import LoopState, find_resume, maybe_save, restore
from miles_disagg.loop.trainer_restart import LoopProgress, TrainerRestarts
from miles_disagg.loop.updates import publish, publish_and_update, start_update
from miles_disagg.loop.waiting import still
from miles_disagg.rollout.debug_data import load_groups, save_groups
from miles_disagg.tracking import TRAIN_STEPS_STREAM, UPDATES_STREAM, MetricsTracker, pass_at_k, status
from miles_disagg.trainer.sequence_advantages import assign_advantages
from miles_disagg.trainer.torch_dist import initial_checkpoint
from miles_disagg.samples import RolloutBatch


def train_async(job: Job, tracker: MetricsTracker, state: LoopState, progress: LoopProgress | None = None) -> None:
    """Generation never stops; a published version is activated on the engines while the
    trainer already trains on the next batch.

    Each step's record is written as soon as the step is done (trained, published, evaluated)
    and before its save, so a crash never loses a completed step (a resumed run drops records of
    the steps it runs again). The activation of the version a
    step published finishes later: its timings and the engines' versions go to the
    ``updates`` stream (keyed by that step) when the loop next waits for it, before it starts
    the next activation (one at a time) or at the end of the run. ``progress``: where the loop
    is, for a trainer restart (``loop/trainer_restart.py``) to take over from."""
    cfg = job.config
    progress = progress or LoopProgress()
    version = state.version
    job.rollout.start()
    busy = BusyMeter(job.router_url if cfg.rollout.router == "builtin" else None)
    activated = None  # what the status line says about the newest finished activation
    for step in range(state.step, cfg.rollout.num_rollout):
        progress.step = step
        start = time.perf_counter()
        with still(f"waiting for {cfg.rollout.rollout_batch_size} groups from the rollout", detail=_serving(job)):
            batch = job.rollout.take(cfg.rollout.rollout_batch_size, version)
        got_batch = time.perf_counter()
        if cfg.rollout.save_debug_rollout_data:
            save_groups(cfg.rollout.save_debug_rollout_data.format(rollout_id=step), batch.groups, version)
        train_metrics = _train(job, tracker, step, batch)
        trained = time.perf_counter()
        update_metrics = {}
        if (step + 1) % cfg.weights.update_weights_interval == 0:
            activated = _log_activation(tracker, cfg, progress.activating)  # one at a time: the previous one first
            progress.activating = None
            version, update_metrics, pending = _begin_update(job, version)
            progress.activating = (step, pending) if pending is not None else None
            job.rollout.set_version(version)
        last = step == cfg.rollout.num_rollout - 1
        with still(f"evaluating v{version}"):
            update_metrics.update(maybe_evaluate(job, step, version, last=last))
        timings = {"perf/wait_rollout_time": got_batch - start, "perf/train_time": trained - got_batch,
                   "perf/step_time": time.perf_counter() - start, "perf/engine_busy_fraction": busy.fraction()}
        _log_step(tracker, cfg, step, batch, train_metrics, update_metrics, timings, note=activated)
        activated = None
        with still(f"saving step {step}"):
            maybe_save(job, LoopState(step + 1, version), last=last)  # after the record: a resume never misses it
    _log_activation(tracker, cfg, progress.activating)
    progress.activating = None


def _begin_update(job: Job, version: int):
    if job.config.weights.update_weight_transfer_mode == "broadcast":
        with still(f"publishing v{version + 1} and bringing every engine to it"):
            version, metrics = publish_and_update(job, version)
        return version, metrics, None
    version, metrics = publish(job, version)
    return version, metrics, start_update(job, version)


def _log_activation(tracker: MetricsTracker, config: RunConfig, activating) -> str | None:
    """Wait for the activation in flight (if any) and append it to the ``updates`` stream;
    a few words about it for the status line."""
    if activating is None:
        return None
    step, pending = activating
    with still(f"waiting for the engines to activate v{pending.version}"):
        metrics = pending.finish()
    if not metrics:  # service topology: the replicas converge on their own
        return None
    record = tracker.log_stream(UPDATES_STREAM, step, {"weights/version": pending.version, **metrics})
    check_step(record, config)  # --ci-test: every engine serves the published version
    pause = record.get("perf/update_weights_pause_time")
    return f"v{pending.version} active" + (f" (pause {pause * 1e3:.0f} ms)" if pause is not None else "")


def _train(job: Job, tracker: MetricsTracker, step: int, batch: RolloutBatch) -> dict:
    """Train on the batch; each optimizer step goes to the ``train_steps`` stream at once
    (``step`` = global optimizer step ``rollout_step * steps_per_rollout + k``); returns the
    rollout's summary for its record. With a critic (PPO) both groups train (``loop/critic.py``)."""
    samples = _advantages(batch, job.config.train)
    whole = len(samples) - len(samples) % (job.config.train.global_batch_size or len(samples) or 1)
    trimmed, samples = len(samples) - whole, samples[:whole]  # miles' trim: a session's extra branch samples
    with still(f"training on step {step}'s {len(samples)} samples"):
        result = train_with_critic(job, step, samples) if job.critic is not None else job.trainer.train(samples)
    for k, metrics in enumerate(result.steps):
        tracker.log_stream(TRAIN_STEPS_STREAM, step * len(result.steps) + k,
                           {"rollout_step": step, "step_in_rollout": k, **metrics})
    return {**result.summary(), **({"rollout/trimmed_samples": trimmed} if trimmed else {})}


def train_sync(job: Job, tracker: MetricsTracker, state: LoopState, progress: LoopProgress | None = None) -> None:
    cfg = job.config
    progress = progress or LoopProgress()
    version = state.version
    busy = BusyMeter(job.router_url if cfg.rollout.router == "builtin" else None)
    for step in range(state.step, cfg.rollout.num_rollout):
        progress.step = step
        start = time.perf_counter()
        batch = _rollout_batch(job, step, version)
        got_batch = time.perf_counter()
        handoff = _colocated_handoff(job)
        train_metrics = {} if cfg.rollout.debug_rollout_only else {**_train(job, tracker, step, batch), **handoff}
        trained = time.perf_counter()
        update_metrics = {}
        if not cfg.rollout.debug_rollout_only and job.engines is not None:
            with still(f"publishing v{version + 1} and bringing every engine to it"):
                version, update_metrics = publish_and_update(job, version)
        last = step == cfg.rollout.num_rollout - 1
        with still(f"evaluating v{version}"):
            update_metrics.update(maybe_evaluate(job, step, version, last=last))
        timings = {"perf/rollout_time": got_batch - start, "perf/train_time": trained - got_batch,
                   "perf/step_time": time.perf_counter() - start, "perf/engine_busy_fraction": busy.fraction()}
        _log_step(tracker, job.config, step, batch, train_metrics, update_metrics, timings)
        if job.trainer is not None:
            with still(f"saving step {step}"):
                maybe_save(job, LoopState(step + 1, version), last=last)  # after the record: a resume never misses it


def _serving(job: Job):
    """What a progress line adds while the loop waits for groups: how many engines serve now."""
    if job.engines is None:
        return None

    def serving() -> str:
        capacity = job.engines.capacity()
        return f"{capacity['live']} of {capacity['total']} engine(s) serving"

    return serving


def _advantages(batch: RolloutBatch, train_config) -> list:
    """The batch's samples with advantages: the estimator's, unless the rollout already set them
    (``--custom-reward-post-process-path``)."""
    if batch.advantages_given:
        return [s for g in batch.groups for s in g.samples]
    return assign_advantages(batch.groups, train_config)


def _colocated_handoff(job: Job) -> dict:
    """``--colocate``: the engines release their memory and the trainer onloads (loop/colocate.py)."""
    if not (job.config.cluster.colocate and job.trainer is not None and job.engines is not None):
        return {}
    from miles_disagg.loop.colocate import to_trainer

    return to_trainer(job.trainer, job.engines)


def _rollout_batch(job: Job, step: int, version: int) -> RolloutBatch:
    cfg = job.config.rollout
    if cfg.load_debug_rollout_data:
        groups = load_groups(cfg.load_debug_rollout_data.format(rollout_id=step))
        from miles_disagg.rollout.buffer import summarize

        return RolloutBatch(groups, {"rollout/raw_reward": _mean_reward(groups), **summarize(groups, version, 0).metrics()})
    with still(f"generating {cfg.rollout_batch_size} groups", detail=_serving(job)):
        batch = job.rollout.generate(cfg.rollout_batch_size, version)
    if cfg.save_debug_rollout_data:
        save_groups(cfg.save_debug_rollout_data.format(rollout_id=step), batch.groups, version)
    return batch


def _mean_reward(groups) -> float:
    rewards = [s.reward for g in groups for s in g.samples]
    return sum(rewards) / len(rewards) if rewards else 0.0


def _log_step(tracker: MetricsTracker, config: RunConfig, step: int, batch: RolloutBatch, train_metrics: dict,
              update_metrics: dict, timings: dict, note: str | None = None) -> None:
    rollout_metrics = dict(batch.metrics)
    if config.tracking.log_passrate:
        rollout_metrics.update(pass_at_k([s.reward for s in g.samples] for g in batch.groups))
    record = tracker.log(step, step_record(train_metrics, rollout_metrics, update_metrics, timings, batch.num_samples))
    check_step(record, config)
    parts = [f"step {step}", f"reward {record.get('rollout/raw_reward', 0):.3f}",
             f"staleness max {record.get('rollout/staleness_max', 0):.0f}"]
    if "weights/version" in record:
        pause = record.get("perf/update_weights_pause_time")
        parts.append(f"v{record['weights/version']} ({record['perf/update_weights_wire_bytes'] / 1024:.0f} KiB"
                     + (f", pause {pause * 1e3:.0f} ms)" if pause is not None else ")"))
    if note:
        parts.append(note)
    parts.append(f"{timings['perf/step_time']:.2f}s")
    status(" | ".join(parts))


def run(config: RunConfig) -> None:
    """Start the job, run the entry's loop, stop the job, write the report: however the run ends once
    it started (completed, failed, interrupted), ``summary.json`` says how (``ended``, ``end_reason``)."""
    from miles_disagg.loop.report import write_end_report

    try:
        _run_job(config)
    except BaseException as exc:
        write_end_report(config.tracking.run_dir, exc)
        raise
    write_end_report(config.tracking.run_dir, None)


def _run_job(config: RunConfig) -> None:
    with_engines = not config.rollout.debug_train_only
    found = find_resume(config)
    initial = initial_checkpoint(config.train.load, config.train.ref_load, resuming=found is not None)
    job = Job.start(config, with_trainer=not config.rollout.debug_rollout_only, with_engines=with_engines,
                    run_id=found[1].run_id if found else None, data_position=found[1].data_position if found else 0,
                    initial_checkpoint=initial)
    tracker = open_tracker(config, start_step=found[1].step if found else 0)  # each step logged once after --load
    try:
        state = restore(job, found)
        asynchronous = config.entry == "train_async" and not (config.rollout.debug_rollout_only or
                                                               config.rollout.debug_train_only)
        TrainerRestarts(job, tracker, resumed_from=found).run(train_async if asynchronous else train_sync, state)
    finally:
        tracker.close()
        job.stop()
