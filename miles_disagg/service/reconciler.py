"""The replica's reconcile loop body: bring one engine to the store's newest version.

A pass (:meth:`Reconciler.run_pass`), one at a time:

1. Read the store's head. Nothing to do when the engine already serves it.
2. **Stage** while serving: ``/pull_weights`` fetches, verifies lineage and final-state
   checksums into the host-local checkpoint and loads the tensors into RAM. Then the head
   is read again; if newer versions were published meanwhile the newest is staged straight
   away (**coalescing**: the materializer applies the chain from what was just staged), at
   most ``max_restages`` times, so a fast publisher cannot starve activation.
3. **Activate** in a short pause: report ``activating`` to the gateway (no new requests
   are routed here), pause, load the staged version, continue (always, whatever
   happened), check that the engine reports the version. LoRA adapter versions
   (``adapter_versions``) need no pause: the engine loads the version beside the served one in
   one call, and the replica stays in routing on its current version until it is acknowledged.
4. **Acknowledge**: only now is the new version advertised (state ``ready``).

Failure contract:

* A staging failure (store unreadable, version not published, lineage/checksum/layout
  refused, engine unreachable) changes nothing live: the replica keeps serving its
  current version (or stays ``catching_up``), records the error, and retries the same
  target with a growing backoff (a newer head is tried at once).
* After activation started, any failure takes the replica out of rotation (``failed``)
  and forgets which version is live, so the next pass stages and activates the head
  again before the replica is ``ready``.

The stage and activate steps are :mod:`miles_disagg.engines.activation`'s (the lifecycle the
managed rollout uses too). Ports (fakes in unit tests): ``store.head()`` (:mod:`.adapters`),
``engine.pull/pause/flush/load/resume/version`` (:class:`~miles_disagg.engines.client.EngineClient`), ``notify()`` (send a heartbeat now, best
effort), ``phase_hook(phase, version)``. Clocks are injectable.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Callable, Protocol

from miles_disagg.engines.activation import ActivationFailed, EnginePort, activate
from miles_disagg.service.protocol import MAX_ACTIVATIONS_REPORTED, Activation, ReplicaState, StoreHead
from miles_disagg.types import FailRun, VersionRef

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)

PhaseHook = Callable[[str, int], None]  # (phase, version)


class StoreRolledBack(FailRun):
    """The store's head is older than the version this replica serves, within one run."""


class StorePort(Protocol):
    def head(self) -> StoreHead | None: ...


class PassOutcome(str, Enum):
    UP_TO_DATE = "up_to_date"
    ACTIVATED = "activated"
    STAGING_FAILED = "staging_failed"
    BACKING_OFF = "backing_off"
    ACTIVATION_FAILED = "activation_failed"


@dataclass(frozen=True, kw_only=True)
class ReconcileConfig:
    """How a replica stages and activates."""

    pause_mode: str = "retract"
    """``/pause_generation`` mode: ``retract`` (in-flight requests resume on the new weights after
    a re-prefill), ``in_place`` (they keep their KV) or ``abort``."""
    max_restages: int = 2
    """Newer versions staged straight away after a stage completes, before activating."""
    adapter_versions: bool = False
    """The engine serves LoRA adapter versions (``--lora-base-dir``): activation loads the version
    beside the served one in one call (``/activate_weights``) with no pause, so the replica stays in
    routing on its current version meanwhile (no ``activating`` state, no ``paused`` phase)."""

    def __post_init__(self) -> None:
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.max_restages < 0:
            raise ValueError(f"max_restages must be >= 0, got {self.max_restages}")


@dataclass
class ReplicaRecord:
    """What the replica reports about itself (copied out by :meth:`Reconciler.snapshot`)."""

    state: ReplicaState = ReplicaState.STARTING
    live: VersionRef | None = None  # None: unknown (fresh attach, or after a failed activation)
    staged_version: int | None = None
    store_head: StoreHead | None = None
    last_error: str | None = None
    activations: list[Activation] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: {
        "num_passes": 0, "num_activations": 0, "num_staging_failures": 0, "num_activation_failures": 0,
        "num_restages": 0, "num_engine_restarts": 0})


def needs_sync(live: VersionRef | None, head: StoreHead) -> bool:
    """Whether an engine serving ``live`` must move to ``head``.

    Unknown live weights always sync; an empty store (head version 0: wiped for a new run)
    resets a host to the base; another run's head (a new run took over the store) always
    syncs (the materializer reseeds); within a run only a newer head does, and an older one
    is ``StoreRolledBack`` (never move a host backwards silently).
    """
    if live is None:
        return True
    if head.version == 0:
        return live.version != 0
    if live.run_id and head.run_id and live.run_id != head.run_id:
        return True
    if head.version < live.version:
        raise StoreRolledBack(f"the store's head is v{head.version} (run {head.run_id!r}) but this replica "
                              f"serves {live}; a published version never goes backwards within a run")
    return head.version > live.version


class Reconciler:
    """One engine's reconcile state machine; see the module docstring.

    Concurrency: passes are serialized by a lock; :meth:`snapshot` may be called from any
    thread at any time (it never waits for a pass).
    """

    def __init__(self, store: StorePort, engine: EnginePort, *, config: ReconcileConfig | None = None,
                 notify: Callable[[], None] = lambda: None, phase_hook: PhaseHook | None = None,
                 clock: Callable[[], float] = time.time, timer: Callable[[], float] = time.perf_counter):
        self.store, self.engine = store, engine
        self.config = config or ReconcileConfig()
        self.notify, self.phase_hook = notify, phase_hook
        self.clock, self.timer = clock, timer
        self._record = ReplicaRecord()
        self._state_lock = threading.Lock()
        self._pass_lock = threading.Lock()
        self._retry: tuple[StoreHead, int, float] | None = None  # (failed target, failures, retry at)

    # ------------------------------------------------------------------ state

    def snapshot(self) -> ReplicaRecord:
        with self._state_lock:
            r = self._record
            return replace(r, activations=list(r.activations), counters=dict(r.counters))

    def _update(self, notify: bool = True, **changes) -> None:
        with self._state_lock:
            for key, value in changes.items():
                setattr(self._record, key, value)
        if notify:
            self.notify()

    def _count(self, name: str) -> None:
        with self._state_lock:
            self._record.counters[name] = self._record.counters.get(name, 0) + 1

    def engine_started(self, live: VersionRef | None, *, restarted: bool = False) -> None:
        """The engine is up holding ``live`` (a fresh built-in engine: the base, v0). The replica
        registers as ``catching_up``: it takes no traffic before its first pass completes."""
        if restarted:
            self._count("num_engine_restarts")
        self._update(state=ReplicaState.CATCHING_UP, live=live, staged_version=None)

    def engine_lost(self, reason: str) -> None:
        """The engine died: out of rotation, live weights unknown, until it is back and caught up."""
        self._update(state=ReplicaState.FAILED, live=None, staged_version=None, last_error=reason)

    def retry_now(self) -> None:
        """A wake: the next pass tries a target that failed at once, not after its backoff (what it
        waited for, e.g. a run writing its adapter chain's version 0, may be there now)."""
        self._retry = None

    def draining(self) -> None:
        self._update(state=ReplicaState.DRAINING)

    # ------------------------------------------------------------------ one pass

    def run_pass(self) -> PassOutcome:
        """Reconcile once (see the module docstring); never raises for engine or store faults."""
        with self._pass_lock:
            if self.snapshot().state in (ReplicaState.STARTING, ReplicaState.DRAINING):
                return PassOutcome.UP_TO_DATE
            self._count("num_passes")
            try:
                head = self.store.head() or StoreHead(0)
                self._update(notify=False, store_head=head)
                if not needs_sync(self.snapshot().live, head):
                    self._mark_ready_if_caught_up()
                    return PassOutcome.UP_TO_DATE
                if self._backing_off(head):
                    return PassOutcome.BACKING_OFF
                staged, prepare_s, restages = self._stage(head)
            except Exception as exc:  # noqa: BLE001 - every staging fault is reported, none is fatal
                return self._staging_failed(exc)
            self._retry = None
            return self._activate(staged, prepare_s, restages)

    def _mark_ready_if_caught_up(self) -> None:
        record = self.snapshot()
        if record.state in (ReplicaState.CATCHING_UP, ReplicaState.FAILED) and record.live is not None:
            self._update(state=ReplicaState.READY, last_error=None)

    def _backing_off(self, head: StoreHead) -> bool:
        retry = self._retry
        return retry is not None and retry[0] == head and self.clock() < retry[2]

    def _stage(self, head: StoreHead) -> tuple[StoreHead, float, int]:
        """Pull ``head`` (then newer heads, coalescing); returns (staged head, prepare seconds, restages)."""
        start = self.timer()
        restages = 0
        while True:
            self._hook("staging", head.version)
            self.engine.pull(head.version)
            self._update(notify=False, staged_version=head.version)
            self._hook("staged", head.version)
            newest = self.store.head() or StoreHead(0)
            if restages >= self.config.max_restages or not _newer(newest, head):
                return head, self.timer() - start, restages
            log.info("v%d was published while v%d was staging: staging v%d straight away",
                     newest.version, head.version, newest.version)
            self._count("num_restages")
            self._update(notify=False, store_head=newest)
            head, restages = newest, restages + 1

    def _staging_failed(self, exc: Exception) -> PassOutcome:
        message = f"staging failed: {type(exc).__name__}: {exc}"
        record = self.snapshot()
        head = record.store_head
        retry = self._retry  # read once: a wake may clear it meanwhile (retry_now)
        failures = retry[1] + 1 if retry is not None and retry[0] == head else 1
        wait_s = RETRY_BACKOFF_S[min(failures, len(RETRY_BACKOFF_S)) - 1]
        self._retry = (head, failures, self.clock() + wait_s) if head is not None else None
        if record.last_error != message:
            log.warning("%s (still serving %s; retrying in %.1fs)", message, record.live, wait_s)
        self._count("num_staging_failures")
        self._update(last_error=message)
        return PassOutcome.STAGING_FAILED

    def _activate(self, head: StoreHead, prepare_s: float, restages: int) -> PassOutcome:
        """Pause, load, continue, check; acknowledge only after all of it succeeded."""
        version = head.version
        paused = None if self.config.adapter_versions else (lambda: self._hook("paused", version))
        if paused is not None:
            self._update(state=ReplicaState.ACTIVATING)  # the gateway stops routing here before the pause
        try:
            pause_s = activate(self.engine, version, pause_mode=self.config.pause_mode, on_paused=paused,
                               timer=self.timer)
        except ActivationFailed as exc:
            return self._activation_failed(version, str(exc))
        activation = Activation(version, head.published_unix, self.clock(), prepare_s, pause_s, restages)
        with self._state_lock:
            kept = (self._record.activations + [activation])[-MAX_ACTIVATIONS_REPORTED:]
        self._count("num_activations")
        self._update(state=ReplicaState.READY, live=VersionRef(head.run_id, version), staged_version=None,
                     last_error=None, activations=kept)  # the acknowledgement
        self._hook("activated", version, quiet=True)
        log.info("activated v%d (prepare %.3fs, pause %.3fs)", version, prepare_s, pause_s)
        return PassOutcome.ACTIVATED

    def _activation_failed(self, version: int, message: str) -> PassOutcome:
        log.error("%s; out of rotation until a later activation succeeds", message)
        self._count("num_activation_failures")
        self._update(state=ReplicaState.FAILED, live=None, staged_version=None, last_error=message)
        self._hook("failed", version, quiet=True)
        return PassOutcome.ACTIVATION_FAILED

    def _hook(self, phase: str, version: int, quiet: bool = False) -> None:
        """Run the phase hook; its exception fails the phase unless ``quiet`` (then it is logged)."""
        if self.phase_hook is None:
            return
        try:
            self.phase_hook(phase, version)
        except Exception:
            if not quiet:
                raise
            log.exception("phase hook failed at %s v%d", phase, version)


def _newer(candidate: StoreHead, than: StoreHead) -> bool:
    if candidate.run_id and than.run_id and candidate.run_id != than.run_id:
        return True
    return candidate.version > than.version
