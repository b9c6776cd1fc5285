"""``--max-trainer-restarts N``: a trainer failure restarts the trainer group inside the run.

A trainer failure is :class:`~miles_disagg.types.TrainerLost` (a rank's process died during a
call of the trainer group, ``trainer/group.py``) or :class:`~miles_disagg.types.NodeLost` for a
node that runs a trainer rank (raised by the run's node watch, ``loop/cluster.py``, during any
wait of the driver). Any other error still ends the run. Up to ``N`` times the loop is caught,
and :class:`TrainerRestarts`:

1. lets the activation in flight (if any) finish: the engines serve a committed version;
2. replaces the trainer group (``Job.restart_trainer``): the old ranks are killed, new ones
   start in the same bundles and continue the run's version stream;
3. restores the newest complete save of ``--save`` (else the save this run resumed from with
   ``--load``, else the run's start: ``--hf-checkpoint`` or the torch_dist checkpoint, step 0);
4. reconciles with the version store as a resume does (``loop/resume.py``): if the store's
   newest version is not the restored state's, the trainer republishes its state as a ``full``
   anchor with the next number (``LATEST + 1``: never a reused number), and the engines are
   brought to it. Versions published after the save (``saved + 1 .. LATEST``) are not in the
   restored trainer's lineage: groups generated on them are dropped from the rollout buffer
   and on arrival (``GroupBuffer.discard_versions``), whatever ``--max-weight-staleness`` is,
   and counted with the stale drops. Groups of older versions keep their true version and the
   usual bound (their staleness against the anchor overestimates their distance from it);
5. drops the records of the steps after the save (``MetricsTracker.rewind``) and runs them
   again, with the groups the rollout has (it never stopped; prompts are not rewound, so the
   data position keeps moving forward and the next save records it);
6. logs one line and an ``events.jsonl`` record (what failed, restart k of N, resumed from
   step S, the anchor), which the run summary lists.

Meanwhile the rollout manager (train_async) keeps generating into its window on the version
the engines serve.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from miles_disagg.loop.resume import LoopState
from miles_disagg.loop.run_files import EVENTS_STREAM
from miles_disagg.tracking import UPDATES_STREAM, MetricsTracker, status
from miles_disagg.trainer.checkpoint import SaveMeta, find_latest
from miles_disagg.types import NodeLost, TrainerLost

FLAG = "--max-trainer-restarts"
PLACE_TIMEOUT_S = 900.0
"""How long a restarted rank may wait for its bundle (after a node loss, Ray places the bundles
of the lost node again once a node offers the resources) before the run ends."""


@dataclass
class LoopProgress:
    """What a training loop has in flight, for a restart to settle: the step it runs and the
    activation it started (``(step, PendingUpdate)``, train_async) and has not yet waited for."""

    step: int = 0
    activating: tuple | None = None


def trainer_failure(exc: BaseException, job) -> str | None:
    """What failed, when ``exc`` is a trainer failure a restart can cure; else None."""
    if isinstance(exc, TrainerLost):
        return str(exc)
    if isinstance(exc, NodeLost) and job.trainer is not None and exc.node_id and exc.node_id in job.trainer.node_ids:
        return str(exc)
    return None


class TrainerRestarts:
    """Runs a training loop, restarting the trainer group on a trainer failure up to
    ``--max-trainer-restarts`` times (see the module's docstring)."""

    def __init__(self, job, tracker: MetricsTracker, resumed_from: tuple[Path, SaveMeta] | None,
                 limit: int | None = None):
        """``resumed_from``: the save this run started from (``--load``); ``limit``: the number
        of restarts allowed (default ``--max-trainer-restarts``)."""
        self.job, self.tracker, self.resumed_from = job, tracker, resumed_from
        self.limit = job.config.train.max_trainer_restarts if limit is None else limit
        self.count = 0

    def run(self, loop: Callable, state: LoopState) -> None:
        """``loop(job, tracker, state, progress)`` until it returns."""
        while True:
            progress = LoopProgress(step=state.step)
            try:
                return loop(self.job, self.tracker, state, progress)
            except Exception as exc:
                state = self._recover(exc, progress)

    def _recover(self, exc: Exception, progress: LoopProgress) -> LoopState:
        """Restart after ``exc`` (again after each trainer failure while restarting); re-raises
        what is no trainer failure, or the last one when the restarts are used up."""
        while True:
            what = trainer_failure(exc, self.job)
            if what is None:
                raise exc
            if self.count >= self.limit:
                raise self._final(exc, what) from exc
            self.count += 1
            status(f"trainer failed at step {progress.step}: {what}; restarting the trainer group "
                   f"(restart {self.count} of {self.limit})")
            try:
                return self._restart(what, progress, lost_node=_node_to_unwatch(exc, self.job))
            except Exception as again:
                exc = again

    def _final(self, exc: Exception, what: str) -> Exception:
        """The error that ends the run: the failure, with how restarts stood."""
        hint = (f" ({FLAG} N restarts the trainer from its last save)" if self.limit == 0 else
                f" (restarted {self.count} time(s) already: {FLAG} {self.limit})")
        if isinstance(exc, NodeLost):
            return NodeLost(what + hint, node_id=exc.node_id, node_ip=exc.node_ip)
        return TrainerLost(what + hint, rank=getattr(exc, "rank", -1), node_id=getattr(exc, "node_id", ""))

    def _restart(self, what: str, progress: LoopProgress, lost_node: str | None) -> LoopState:
        job, started = self.job, time.perf_counter()
        settled = _settle_activation(progress)
        if lost_node:
            _stop_watching(job, lost_node)
        job.restart_trainer(place_timeout_s=PLACE_TIMEOUT_S)
        point = self._restart_point()
        step, held, origin = 0, (1 if job.initial_checkpoint else 0), "the start of the run"
        if point is not None:
            path, meta = point
            job.trainer.load(str(path))
            step, held, origin = meta.step, meta.version, str(path)
        version, discarded, dropped = _reconcile(job, held)
        self.tracker.rewind(step)
        if settled is not None and settled[0] < step:  # its step's record stays: so does its activation
            self.tracker.log_stream(UPDATES_STREAM, settled[0], settled[1])
        event = {"event": "trainer_restart", "failed": what, "failed_at_step": progress.step, "restart": self.count,
                 "max_restarts": self.limit, "resumed_from_step": step, "resumed_from": origin, "version": version,
                 "discarded_versions": list(discarded) if discarded else None, "groups_dropped": dropped,
                 "restart_s": round(time.perf_counter() - started, 3)}
        self.tracker.log_stream(EVENTS_STREAM, step, event)
        status(f"trainer restart {self.count} of {self.limit}: resumed from step {step} ({origin}) at v{version}"
               + (f"; {dropped} buffered group(s) of v{discarded[0]}-v{discarded[1]} dropped (not in the restored "
                  "lineage)" if discarded else "") + f" ({time.perf_counter() - started:.1f}s)")
        return LoopState(step=step, version=version)

    def _restart_point(self) -> tuple[Path, SaveMeta] | None:
        """The newest complete save of ``--save``, else the one this run resumed from."""
        save = self.job.config.train.save
        return (find_latest(save) if save else None) or self.resumed_from


def _settle_activation(progress: LoopProgress) -> tuple[int, dict] | None:
    """Wait for the activation in flight (the engines are not the trainer: it goes on); its
    ``(step, updates record)``, or None (none in flight, or it failed: a status line)."""
    if progress.activating is None:
        return None
    step, pending = progress.activating
    progress.activating = None
    try:
        metrics = pending.finish()
    except Exception as exc:  # the restart brings the engines to its own version anyway
        status(f"the activation of v{pending.version} did not finish: {type(exc).__name__}: {exc}")
        return None
    return (step, {"weights/version": pending.version, **metrics}) if metrics else None


def _reconcile(job, held: int) -> tuple[int, tuple[int, int] | None, int]:
    """Bring the store, the engines and the rollout to the restored trainer; the version they
    serve, the range of versions that left the lineage (None: none) and how many buffered groups
    of those versions were dropped."""
    from miles_disagg.loop.updates import wake_service

    latest = job.trainer.latest_published()
    store_version = latest["version"] if latest else 0
    version, discarded = store_version, None
    if store_version != held:
        version = job.trainer.publish_full().ref.version
        if store_version > held:
            discarded = (held + 1, store_version)
        status(f"store was at v{store_version}, the restored trainer holds v{held}: republished its state as full "
               f"v{version}")
    if job.engines is not None and version > 0 and any(v != str(version) for v in job.engines.versions()):
        job.engines.update_weights(version)
        status(f"engines at v{version}")
    elif job.config.rollout.rollout_service_url:
        wake_service(job.config.rollout.rollout_service_url)
    dropped = 0
    if job.rollout is not None:
        if discarded is not None:
            dropped = job.rollout.discard_versions(*discarded)
        job.rollout.set_version(version)
    return version, discarded, dropped


def _node_to_unwatch(exc: Exception, job) -> str | None:
    """The node the run's watch stops watching at this restart: a lost trainer node (the watch
    raises for every later wait once a node is gone), or the node of a rank that died when only
    trainer ranks ran there (the node may be going away: Ray can report the rank's death before
    the node's, and the restart must not count that loss a second time). A trainer node that is
    not watched is still covered: a rank that dies there ends its call with ``TrainerLost``."""
    if isinstance(exc, NodeLost):
        return exc.node_id
    node = getattr(exc, "node_id", "")
    site = job.node_watch.nodes.get(node) if job.node_watch is not None else None
    if site and all(work.startswith("trainer rank") for work in site["work"]):
        return node
    return None


def _stop_watching(job, lost_node: str) -> None:
    """The run's node watch stops watching ``lost_node`` (see ``_node_to_unwatch``); the other
    nodes stay watched, with everything else the watch knows (which lost rollout nodes the run
    already went on without, whether engines are placed again, the trainer-node handler)."""
    if job.node_watch is not None:
        job.node_watch.unwatch(lost_node)  # the loss it kept raising is taken over by the restart
