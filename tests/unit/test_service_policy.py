"""Pure parts of the rollout service: scaling policy, fleet table, convergence and request metrics."""

from __future__ import annotations

import pytest

from miles_disagg.service.fleet import Fleet
from miles_disagg.service.metrics import ConvergenceTracker, RequestStats, percentile
from miles_disagg.service.protocol import Activation, ReplicaState, ReplicaStatus, StoreHead
from miles_disagg.service.scaling import Autoscaler, LoadSnapshot, ScalingConfig, desired_replicas
from miles_disagg.types import InvalidInput, VersionConstraint

# --------------------------------------------------------------------------- scaling

CONFIG = ScalingConfig(min_replicas=1, max_replicas=4, target_in_flight_per_replica=4, tolerance=0.25,
                       scale_down_delay_s=10, max_scale_down_step=1)


@pytest.mark.parametrize("in_flight,unserved,current,expected", [
    (0, 0, 0, 1),     # nothing to do: the minimum
    (0, 0, 3, 1),     # idle: down to the minimum
    (8, 0, 1, 2),     # 8 in flight at 4 each
    (11, 0, 2, 3),    # 11/8 is outside the tolerance band: one more
    (9, 0, 2, 2),     # 9/8 is inside it: keep
    (9, 0, 3, 3),     # 9/12 = 0.75 is inside it too
    (100, 0, 2, 4),   # capped at the maximum
    (0, 3, 1, 2),     # requests found no ready replica: at least one more
    (0, 3, 4, 4),     # ... but never above the maximum
])
def test_desired_replicas(in_flight, unserved, current, expected):
    assert desired_replicas(LoadSnapshot(in_flight, unserved), current, CONFIG) == expected


def test_autoscaler_scales_up_at_once_and_down_only_after_the_delay_one_step_at_a_time():
    scaler = Autoscaler(CONFIG)
    assert scaler.decide(in_flight=16, unserved_total=0, current=1, now=0) == 4
    assert scaler.decide(in_flight=0, unserved_total=0, current=4, now=1) == 4  # delay starts
    assert scaler.decide(in_flight=0, unserved_total=0, current=4, now=10.5) == 4
    assert scaler.decide(in_flight=0, unserved_total=0, current=4, now=11) == 3
    assert scaler.decide(in_flight=0, unserved_total=0, current=3, now=12) == 3  # a full delay again
    assert scaler.decide(in_flight=12, unserved_total=0, current=3, now=13) == 3  # demand is back: delay reset
    assert scaler.decide(in_flight=0, unserved_total=0, current=3, now=14) == 3
    assert scaler.decide(in_flight=0, unserved_total=0, current=3, now=23.5) == 3
    assert scaler.decide(in_flight=0, unserved_total=0, current=3, now=24) == 2


def test_autoscaler_reacts_to_new_refusals_not_to_their_running_total():
    scaler = Autoscaler(CONFIG)
    assert scaler.decide(in_flight=0, unserved_total=50, current=1, now=0) == 1  # history before we looked
    assert scaler.decide(in_flight=0, unserved_total=53, current=1, now=1) == 2


@pytest.mark.parametrize("kwargs", [dict(min_replicas=3, max_replicas=2), dict(max_replicas=0),
                                    dict(target_in_flight_per_replica=0), dict(tolerance=1.0)])
def test_scaling_config_is_validated(kwargs):
    with pytest.raises(ValueError):
        ScalingConfig(**kwargs)


# --------------------------------------------------------------------------- fleet table


def status(seq: int, state: ReplicaState = ReplicaState.READY, version: int | None = 1, *, replica_id: str = "r0",
           incarnation: str = "i1", url: str = "http://127.0.0.1:9000", head: int | None = None) -> ReplicaStatus:
    return ReplicaStatus(replica_id=replica_id, incarnation=incarnation, seq=seq, engine_url=url, control_url=None,
                         state=state, weight_version=version, run_id="run",
                         store_head=None if head is None else StoreHead(head, "run", 100.0 + head))


def test_heartbeats_map_states_to_router_states_and_stale_ones_are_ignored():
    fleet = Fleet(timeout_s=3, forget_s=10)
    applied = fleet.apply(status(1, ReplicaState.CATCHING_UP, 0), now=0, now_unix=0)
    assert (applied.worker_state, applied.weight_version) == ("paused", None)
    applied = fleet.apply(status(3, ReplicaState.ACTIVATING, 0), now=1, now_unix=1)
    assert applied.worker_state == "activating"
    assert fleet.apply(status(2, ReplicaState.READY, 0), now=2, now_unix=2) is None  # delayed, older
    applied = fleet.apply(status(4, ReplicaState.READY, 1), now=3, now_unix=3)
    assert (applied.worker_state, applied.weight_version) == ("ready", 1)
    # a restarted replica (new incarnation) starts its seq again, on a new engine
    applied = fleet.apply(status(1, ReplicaState.CATCHING_UP, 0, incarnation="i2", url="http://127.0.0.1:9001"),
                          now=4, now_unix=4)
    assert applied.dropped_url == "http://127.0.0.1:9000" and applied.engine_url == "http://127.0.0.1:9001"
    transitions = [t[1:] for t in fleet.get("r0").transitions]
    assert transitions == [("catching_up", 0), ("activating", 0), ("ready", 1), ("catching_up", 0)]


def test_silent_replicas_leave_the_capacity_then_the_table():
    fleet = Fleet(timeout_s=3, forget_s=10)
    fleet.apply(status(1, replica_id="a"), now=0, now_unix=0)
    fleet.apply(status(1, replica_id="b", url="http://127.0.0.1:9001"), now=2, now_unix=2)
    fleet.apply(status(2, ReplicaState.DRAINING, replica_id="c", url="http://127.0.0.1:9002"), now=2, now_unix=2)
    assert fleet.capacity() == [("run", 1), ("run", 1)]  # draining replicas are not capacity
    expired = fleet.expire(now=3.5)
    assert [(e.replica_id, e.forgotten) for e in expired] == [("a", False)]
    assert fleet.capacity() == [("run", 1)] and fleet.get("a").lost
    assert fleet.expire(now=4) == []  # reported once
    fleet.apply(status(2, replica_id="a"), now=5, now_unix=5)
    assert not fleet.get("a").lost
    expired = fleet.expire(now=12.5)
    assert sorted((e.replica_id, e.forgotten) for e in expired) == [("a", False), ("b", True), ("c", True)]


def test_heartbeat_parsing_rejects_malformed_bodies():
    good = status(1, head=2).to_json()
    assert ReplicaStatus.from_json(good) == status(1, head=2)
    for bad in ({**good, "state": "sleeping"}, {**good, "seq": "1"}, {**good, "replica_id": ""}, [good]):
        with pytest.raises(InvalidInput):
            ReplicaStatus.from_json(bad)


# --------------------------------------------------------------------------- metrics


def test_convergence_is_time_from_publication_to_each_capacity_fraction():
    tracker = ConvergenceTracker((0.5, 1.0))
    tracker.observe_head(StoreHead(2, "run", 100.0))
    tracker.observe_fleet([("run", 1), ("run", 1)], now_unix=101)
    assert tracker.converged_s(2, 0.5) is None
    tracker.observe_fleet([("run", 2), None], now_unix=103)  # one replica activating
    assert (tracker.converged_s(2, 0.5), tracker.converged_s(2, 1.0)) == (3.0, None)
    tracker.observe_head(StoreHead(3, "run", 104.0))
    tracker.observe_fleet([("run", 2), ("run", 3)], now_unix=105)  # coalesced past v2: counts for v2
    assert tracker.converged_s(2, 1.0) == 5.0 and tracker.converged_s(3, 0.5) == 1.0
    tracker.observe_fleet([("run", 3), ("run", 3)], now_unix=106)
    assert tracker.converged_s(3, 1.0) == 2.0
    tracker.observe_fleet([("other", 9), ("other", 9)], now_unix=107)  # another run never counts
    assert tracker.to_json()["versions"]["3"]["converged_s"] == {"0.5": 1.0, "1": 2.0}


def test_request_stats_lag_violations_and_overhead():
    stats = RequestStats()
    stats.observe(200, VersionConstraint(min_version=2), [(2, 3), (3, 3)], newest=4, total_s=0.5, upstream_s=0.49)
    stats.observe(200, VersionConstraint(exact_version=2), [(1, 1)], newest=4, total_s=0.2, upstream_s=0.2)
    stats.observe(409, VersionConstraint(exact_version=9), [], newest=4, total_s=0.001, upstream_s=0)
    report = stats.to_json()
    assert report["counts"] == {"served": 2, "version_not_ready": 1, "samples": 3, "samples_mixed_version": 1,
                                "samples_violating_constraint": 1}
    assert report["version_lag_behind_newest"]["histogram"] == {"1": 1, "2": 1, "3": 1}
    assert report["version_lag_over_min"]["histogram"] == {"0": 1, "1": 1}
    assert report["gateway_overhead_ms"]["count"] == 2
    assert report["gateway_overhead_ms"]["p99"] == pytest.approx(10.0)


def test_percentile_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3, 1, 2], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([5], 99) == 5


def test_activation_records_round_trip_in_heartbeats():
    s = status(1)
    s.activations = [Activation(1, 100.0, 101.0, 0.5, 0.01, 1)]
    assert ReplicaStatus.from_json(s.to_json()).activations == s.activations
