"""The replica's reconcile state machine with a fake store and a fake engine (no I/O).

Races are driven from inside the fakes ("the head advances while v2 stages"), never by
sleeping; the clock is a variable.
"""

from __future__ import annotations

import pytest

from miles_disagg.engines.client import StagingRefused
from miles_disagg.service.protocol import ReplicaState, StoreHead
from miles_disagg.service.reconciler import PassOutcome, ReconcileConfig, Reconciler, StoreRolledBack, needs_sync
from miles_disagg.types import EngineUnrecoverable, VersionRef

RUN = "run-a"


class FakeStore:
    def __init__(self, version: int | None = None, run_id: str = RUN):
        self.version, self.run_id = version, run_id

    def publish(self, version: int) -> None:
        self.version = version

    def head(self) -> StoreHead | None:
        return None if self.version is None else StoreHead(self.version, self.run_id, 1000.0 + self.version)


class FakeEngine:
    """Records every call in ``log``; ``on_pull`` / ``fail`` inject behaviour per call name."""

    def __init__(self, log: list, version: int = 0):
        self.log, self.live, self.staged = log, version, None
        self.fail: dict[str, Exception] = {}
        self.on_pull = lambda version: None
        self.report_override: int | None = None

    def _call(self, name: str, *args) -> None:
        self.log.append((name, *args))
        if name in self.fail:
            raise self.fail.pop(name)

    def pull(self, version: int) -> None:
        self._call("pull", version)
        self.on_pull(version)
        self.staged = version

    def pause(self, mode: str) -> None:
        self._call("pause", mode)

    def flush(self) -> None:
        self._call("flush")

    def load(self, version: int) -> None:
        self._call("load", version)
        self.live = version

    def resume(self) -> None:
        self._call("resume")

    def version(self) -> int | None:
        return self.live if self.report_override is None else self.report_override


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(store_version: int | None = None, *, engine_version: int = 0, **config):
    log: list = []
    store, engine, clock = FakeStore(store_version), FakeEngine(log, engine_version), Clock()
    reconciler = Reconciler(store, engine, config=ReconcileConfig(**config), clock=clock, timer=clock)
    reconciler.notify = lambda: log.append(("notify", reconciler.snapshot().state.value, _live(reconciler)))
    reconciler.engine_started(VersionRef("", engine_version))
    return reconciler, store, engine, clock, log


def _live(reconciler: Reconciler) -> int | None:
    live = reconciler.snapshot().live
    return None if live is None else live.version


def advertised(log: list) -> list[tuple[str, int | None]]:
    return [(state, version) for name, state, version in (e for e in log if e[0] == "notify")]


def test_fresh_engine_and_empty_store_is_ready_at_the_base_without_any_engine_call():
    reconciler, _, _, _, log = make(None)
    assert reconciler.run_pass() is PassOutcome.UP_TO_DATE
    assert reconciler.snapshot().state is ReplicaState.READY
    assert [e for e in log if e[0] != "notify"] == []
    assert advertised(log) == [("catching_up", 0), ("ready", 0)]


def test_stage_then_activate_in_order_and_advertise_only_after_the_engine_reports_the_version():
    reconciler, _, engine, _, log = make(2)
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    calls = [e[:2] for e in log]
    assert calls == [("notify", "catching_up"), ("pull", 2), ("notify", "activating"), ("pause", "retract"),
                     ("flush",), ("load", 2), ("resume",), ("notify", "ready")]
    assert advertised(log)[-1] == ("ready", 2)
    record = reconciler.snapshot()
    assert record.live == VersionRef(RUN, 2) and record.staged_version is None
    assert [a.version for a in record.activations] == [2]
    assert record.activations[0].published_unix == 1002.0


def test_in_place_pause_skips_the_flush():
    reconciler, _, _, _, log = make(1, pause_mode="in_place")
    reconciler.run_pass()
    assert [e[0] for e in log if e[0] != "notify"] == ["pull", "pause", "load", "resume"]


def test_a_head_that_advances_mid_stage_is_staged_straight_away_and_activated_once():
    reconciler, store, engine, _, log = make(2)
    engine.on_pull = lambda version: store.publish(4) if version == 2 else None
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert [e for e in log if e[0] in ("pull", "load")] == [("pull", 2), ("pull", 4), ("load", 4)]
    record = reconciler.snapshot()
    assert record.live.version == 4 and record.counters["num_restages"] == 1
    assert record.activations[-1].num_restages == 1
    assert ("ready", 2) not in advertised(log)


def test_restaging_is_bounded_so_a_fast_publisher_cannot_starve_activation():
    reconciler, store, engine, _, log = make(1, max_restages=1)
    engine.on_pull = lambda version: store.publish(version + 1)  # a new version during every stage
    reconciler.run_pass()
    assert [e for e in log if e[0] in ("pull", "load")] == [("pull", 1), ("pull", 2), ("load", 2)]


def test_a_refused_stage_keeps_serving_the_current_version_and_backs_off():
    reconciler, store, engine, clock, log = make(1)
    reconciler.run_pass()
    store.publish(2)
    engine.fail["pull"] = StagingRefused("checksum mismatch for tensor 'w'")
    log.clear()
    assert reconciler.run_pass() is PassOutcome.STAGING_FAILED
    record = reconciler.snapshot()
    assert record.state is ReplicaState.READY and record.live.version == 1
    assert "checksum mismatch" in record.last_error and record.counters["num_staging_failures"] == 1
    assert [e[0] for e in log if e[0] != "notify"] == ["pull"]  # never paused
    assert advertised(log) == [("ready", 1)]  # the error is reported, the version kept
    assert reconciler.run_pass() is PassOutcome.BACKING_OFF
    clock.now += 10
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert reconciler.snapshot().last_error is None


def test_a_newer_head_is_tried_at_once_after_a_failed_stage():
    reconciler, store, engine, _, _ = make(1)
    engine.fail["pull"] = StagingRefused("lineage")
    assert reconciler.run_pass() is PassOutcome.STAGING_FAILED
    assert reconciler.snapshot().state is ReplicaState.CATCHING_UP  # a new replica stays out of traffic
    store.publish(2)
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert reconciler.snapshot().live.version == 2


@pytest.mark.parametrize("failing", ["pause", "flush", "load"])
def test_a_failed_activation_still_continues_the_engine_and_takes_the_replica_out(failing):
    reconciler, _, engine, _, log = make(3)
    engine.fail[failing] = EngineUnrecoverable(f"{failing} broke")
    assert reconciler.run_pass() is PassOutcome.ACTIVATION_FAILED
    names = [e[0] for e in log]
    assert names.index("resume") > names.index(failing)  # continued after the failure
    record = reconciler.snapshot()
    assert record.state is ReplicaState.FAILED and record.live is None
    assert f"{failing} broke" in record.last_error and record.counters["num_activation_failures"] == 1
    assert advertised(log)[-1] == ("failed", None)
    # the next pass stages and activates the head again before the replica is ready
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert advertised(log)[-1] == ("ready", 3)


def test_an_engine_that_does_not_report_the_activated_version_is_out_of_rotation():
    reconciler, _, engine, _, _ = make(2)
    engine.report_override = 1
    assert reconciler.run_pass() is PassOutcome.ACTIVATION_FAILED
    assert "reports version 1" in reconciler.snapshot().last_error


def test_phase_hook_failures_fail_their_phase():
    reconciler, _, engine, _, log = make(2)
    reconciler.phase_hook = lambda phase, version: (_ for _ in ()).throw(RuntimeError(phase)) if phase == "staging" else None
    assert reconciler.run_pass() is PassOutcome.STAGING_FAILED
    assert not [e for e in log if e[0] == "pull"]
    reconciler, _, engine, _, log = make(2)
    reconciler.phase_hook = lambda phase, version: (_ for _ in ()).throw(RuntimeError(phase)) if phase == "paused" else None
    assert reconciler.run_pass() is PassOutcome.ACTIVATION_FAILED
    assert ("resume",) in log and ("load", 2) not in log


def test_a_lost_engine_is_out_of_rotation_until_restarted_and_caught_up():
    reconciler, _, _, _, log = make(2)
    reconciler.run_pass()
    reconciler.engine_lost("engine exited with code -9")
    assert reconciler.snapshot().state is ReplicaState.FAILED
    reconciler.engine_started(VersionRef("", 0), restarted=True)
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert advertised(log)[-3:] == [("catching_up", 0), ("activating", 0), ("ready", 2)]
    assert reconciler.snapshot().counters["num_engine_restarts"] == 1


def test_no_pass_runs_while_starting_or_draining():
    reconciler, _, _, _, log = make(2)
    reconciler.draining()
    log.clear()
    assert reconciler.run_pass() is PassOutcome.UP_TO_DATE
    assert log == []


def test_needs_sync_rules():
    head = StoreHead(3, RUN)
    assert needs_sync(None, head)
    assert needs_sync(VersionRef(RUN, 2), head)
    assert not needs_sync(VersionRef(RUN, 3), head)
    assert not needs_sync(VersionRef("", 3), head)
    assert needs_sync(VersionRef("other-run", 7), head)  # a new run took over the store
    assert needs_sync(VersionRef(RUN, 7), StoreHead(0))  # a wiped store: back to the base
    assert not needs_sync(VersionRef("", 0), StoreHead(0))
    with pytest.raises(StoreRolledBack):
        needs_sync(VersionRef(RUN, 5), head)


def test_a_rolled_back_store_is_reported_and_the_replica_keeps_serving():
    reconciler, store, _, _, _ = make(3)
    reconciler.run_pass()
    store.publish(2)
    assert reconciler.run_pass() is PassOutcome.STAGING_FAILED
    record = reconciler.snapshot()
    assert record.state is ReplicaState.READY and record.live.version == 3
    assert "StoreRolledBack" in record.last_error


def test_config_is_validated():
    with pytest.raises(ValueError):
        ReconcileConfig(pause_mode="later")
    with pytest.raises(ValueError):
        ReconcileConfig(max_restages=-1)


def test_a_wiped_store_resets_the_replica_to_the_base_before_a_new_run_publishes():
    reconciler, store, _, _, log = make(4)
    reconciler.run_pass()
    store.version = None  # a new run reset the store (LATEST removed)
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert [e for e in log if e[0] in ("pull", "load")][-2:] == [("pull", 0), ("load", 0)]
    assert advertised(log)[-1] == ("ready", 0)
    store.version, store.run_id = 1, "run-b"
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert reconciler.snapshot().live == VersionRef("run-b", 1)


class AdapterEngine(FakeEngine):
    """An engine serving LoRA adapter versions: activation is one call, with no pause."""

    one_call_activation = True

    def activate_in_one_call(self, version: int, pause_mode: str, flush: bool) -> dict:
        self._call("activate_weights", version)
        self.live = version
        return {"weight_version": str(version), "pause_ms": 0.0}


def test_adapter_versions_activate_in_one_call_from_the_chains_v0_staying_in_routing():
    log: list = []
    store, engine, clock = FakeStore(None), AdapterEngine(log), Clock()
    reconciler = Reconciler(store, engine, config=ReconcileConfig(adapter_versions=True), clock=clock, timer=clock)
    reconciler.notify = lambda: log.append(("notify", reconciler.snapshot().state.value, _live(reconciler)))
    reconciler.engine_started(None)  # the bare base is no version this replica serves
    assert reconciler.run_pass() is PassOutcome.ACTIVATED  # an empty store: the adapter chain's version 0
    store.publish(1)
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
    assert [e for e in log if e[0] != "notify"] == [("pull", 0), ("activate_weights", 0), ("pull", 1),
                                                   ("activate_weights", 1)]
    assert advertised(log) == [("catching_up", None), ("ready", 0), ("ready", 1)]  # never "activating"
    assert [a.pause_s for a in reconciler.snapshot().activations] == [0.0, 0.0]


def test_a_wake_retries_a_failed_stage_without_waiting_out_the_backoff():
    reconciler, store, engine, _, _ = make(1)
    engine.fail["pull"] = StagingRefused("the adapter chain's version 0 is not there yet")
    assert reconciler.run_pass() is PassOutcome.STAGING_FAILED
    assert reconciler.run_pass() is PassOutcome.BACKING_OFF
    reconciler.retry_now()
    assert reconciler.run_pass() is PassOutcome.ACTIVATED
