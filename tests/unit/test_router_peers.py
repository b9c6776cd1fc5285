"""A router of several processes (``--router-workers N``), without processes: a leader's registry and a
follower's view over one shared table. What the leader publishes is what every follower routes on, from
its next routing decision; a follower's news reach routing only through the leader."""

from __future__ import annotations

from pathlib import Path

import pytest
from registry_workers import ready

from miles_disagg.router.peers import FollowerPeers, LeaderPeers
from miles_disagg.router.policy import LeastOutstandingPolicy
from miles_disagg.router.registry import WorkerRegistry, WorkerState
from miles_disagg.router.shared_table import (CAPACITY, RING, SharedTable, SlotRecord, bucket_of,
                                              histogram_percentiles_ms)
from miles_disagg.types import InvalidInput, VersionConstraint, VersionNotReady


@pytest.fixture
def pair(tmp_path: Path):
    table = SharedTable.create(tmp_path / "table", 3)
    leader_registry = WorkerRegistry()
    leader = LeaderPeers(leader_registry, table)
    hints: list[dict] = []
    follower_registry = WorkerRegistry()
    follower = FollowerPeers(follower_registry, SharedTable.attach(tmp_path / "table"), 1, hint=hints.append)
    table.set_proc(1, 0, 4242.0)  # the follower is alive (its pid)
    yield leader, follower, hints
    table.close()


def view(follower: FollowerPeers) -> dict[str, tuple[str, int | None]]:
    follower.sync()
    return {w.url: (w.state.value, w.weight_version) for w in follower.registry.workers()}


def test_the_follower_sees_every_change_the_leader_made_before_its_next_decision(pair):
    leader, follower, _ = pair
    a = ready(leader.registry, "http://a:1", 3)
    ready(leader.registry, "http://b:1", 3)
    assert view(follower) == {"http://a:1": ("ready", 3), "http://b:1": ("ready", 3)}
    leader.registry.set_admin_state(a.url, "paused")
    assert view(follower)["http://a:1"] == ("paused", 3)
    leader.registry.record_probe_ok(a, 4, leader.registry.ticket(a))
    leader.registry.set_admin_state(a.url, "ready")
    assert view(follower)["http://a:1"] == ("ready", 4)
    b = leader.registry.remove("http://b:1")
    leader.registry.record_probe_ok(b, 3, leader.registry.ticket(b))  # a probe that was out when it left
    assert view(follower) == {"http://a:1": ("ready", 4)}
    leader.registry.add("http://c:1")  # takes b's slot once the follower has seen b go
    assert view(follower)["http://c:1"] == ("starting", None)


def test_a_version_seen_by_a_follower_is_routed_on_only_once_the_leader_publishes_it(pair):
    leader, follower, hints = pair
    a = ready(leader.registry, "http://a:1", 3)
    follower.sync()
    mine = follower.registry.get(a.url)
    follower.observe_version(mine, 4)
    follower.observe_version(mine, 4)  # once is enough
    assert hints == [{"op": "version", "url": a.url, "version": 4}]
    needs_4 = VersionConstraint(min_version=4)
    with pytest.raises(VersionNotReady):  # not on the follower's word alone
        LeastOutstandingPolicy().choose_in(follower.registry, needs_4)
    leader.apply_hint(1, hints[0])
    assert a.weight_version == 4
    follower.sync()
    assert LeastOutstandingPolicy().choose_in(follower.registry, needs_4) is mine


def test_a_failure_in_a_follower_takes_the_worker_out_there_at_once_and_everywhere_through_the_leader(pair):
    leader, follower, hints = pair
    a = ready(leader.registry, "http://a:1", 3)
    follower.sync()
    mine = follower.registry.get(a.url)
    follower.mark_failed(mine, "connection reset")
    assert mine.state is WorkerState.UNHEALTHY
    leader.registry.set_admin_state(a.url, "ready")  # other news about it before the leader has the failure
    follower.sync()
    assert mine.state is WorkerState.UNHEALTHY  # still out here
    leader.apply_hint(1, hints[-1])
    assert a.state is WorkerState.UNHEALTHY
    leader.registry.record_probe_ok(a, 3, leader.registry.ticket(a))  # a later probe passes
    follower.sync()
    assert mine.state is WorkerState.READY


def test_hints_about_unknown_workers_or_malformed_ones_are_ignored(pair):
    leader, _, _ = pair
    ready(leader.registry, "http://a:1", 3)
    for hint in ({"op": "failed", "url": "http://gone:1"}, {"op": "version", "url": "http://a:1", "version": "9"},
                 {"url": 5}, {}):
        leader.apply_hint(1, hint)
    assert leader.registry.get("http://a:1").state is WorkerState.READY


def test_load_is_summed_over_the_processes(pair):
    leader, follower, _ = pair
    a = ready(leader.registry, "http://a:1", 3)
    follower.sync()
    mine = follower.registry.get(a.url)
    for registry, peers, worker in ((leader.registry, leader, a), (follower.registry, follower, mine)):
        registry.acquire(worker)
        peers.load_changed(worker)
    follower.registry.release(mine, served=True)
    follower.load_changed(mine)
    entry = leader.worker_json(a)
    assert entry["outstanding"] == 1 and entry["num_served"] == 1 and entry["busy_s"] >= 0
    assert leader.last_answer_at(a) == mine.last_answer_at


def test_a_follower_far_behind_reads_every_slot(pair):
    leader, follower, _ = pair
    worker = ready(leader.registry, "http://a:1", 0)
    for version in range(1, RING + 10):
        leader.registry.observe_version(worker, version)
    assert view(follower) == {"http://a:1": ("ready", RING + 9)}


def test_admission_refuses_what_the_table_cannot_hold(pair):
    leader, _, _ = pair
    with pytest.raises(InvalidInput, match="bytes"):
        leader.check_admission("http://" + "h" * 300 + ":1")
    leader.check_admission("http://a:1")  # room
    assert CAPACITY >= 1024


def test_slot_records_and_histograms_round_trip(tmp_path: Path):
    table = SharedTable.create(tmp_path / "t", 2)
    record = SlotRecord(7, True, "http://[::1]:80", "activating", True, True, None, "run-é", 5)
    table.write(record)
    other = SharedTable.attach(tmp_path / "t")
    assert other.changes_since(0) == (1, [record])
    counts = [0.0] * 1024
    for seconds in (0.0001, 0.0002, 0.0002, 0.05):
        counts[bucket_of(seconds)] += 1
    summary = histogram_percentiles_ms(counts)
    assert summary["count"] == 4 and 0.2 <= summary["p50"] <= 0.21 and 50 <= summary["max"] <= 51.5
    with pytest.raises(ValueError):
        SharedTable.attach(_not_a_table(tmp_path))


def _not_a_table(tmp_path: Path) -> Path:
    path = tmp_path / "junk"
    path.write_bytes(b"\0" * 4096)
    return path
