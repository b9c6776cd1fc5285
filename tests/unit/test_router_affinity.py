"""Session affinity (``X-SMG-Routing-Key``): a key stays on the worker that served it last while that
worker can take it, moves (counted) when it cannot; one process keeps keys in a bounded map, several
processes in their shared table, so any process routes a key where another one sent it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from registry_workers import ready

from miles_disagg.router.affinity import (LocalAffinity, choose_for_session, key_hash, routing_key,
                                          version_extra_key)
from miles_disagg.router.peers import FollowerPeers, LeaderPeers, SoleRouter
from miles_disagg.router.policy import LeastOutstandingPolicy
from miles_disagg.router.registry import WorkerRegistry
from miles_disagg.router.shared_table import AFFINITY_SLOTS, SharedTable
from miles_disagg.types import InvalidInput, VersionConstraint, VersionNotReady

ANY = VersionConstraint()


def _route(registry, peers, key, constraint=ANY, skip=frozenset(), counters=None):
    return choose_for_session(LeastOutstandingPolicy(), registry, peers, key, constraint, skip,
                              counters if counters is not None else Counter())


def test_a_key_stays_on_its_worker_even_when_others_are_less_loaded():
    registry = WorkerRegistry()
    workers = [ready(registry, f"http://w{i}:1", 3) for i in range(3)]
    peers, counters = SoleRouter(registry), Counter()
    first = _route(registry, peers, "session-a", counters=counters)
    for _ in range(5):
        registry.acquire(first)  # the session's engine is now the busiest
    assert all(_route(registry, peers, "session-a", counters=counters) is first for _ in range(10))
    assert counters == Counter(session_affinity_hits=10)
    other = _route(registry, peers, "session-b", counters=counters)  # a new session: the least loaded
    assert other is not first and other in workers


@pytest.mark.parametrize("change", ["paused", "unhealthy", "removed", "older version", "tried"])
def test_a_key_moves_when_its_worker_cannot_take_the_request_and_the_move_is_counted(change):
    registry = WorkerRegistry()
    for i in range(3):
        ready(registry, f"http://w{i}:1", 3)
    peers, counters = SoleRouter(registry), Counter()
    first = _route(registry, peers, "s")
    constraint, skip = ANY, frozenset()
    if change == "paused":
        registry.set_admin_state(first.url, "paused")
    elif change == "unhealthy":
        registry.mark_failed(first, "connection refused")
    elif change == "removed":
        registry.remove(first.url)
    elif change == "older version":
        constraint = VersionConstraint(min_version=4)
        for worker in registry.workers():
            if worker is not first:
                registry.record_probe_ok(worker, 4, registry.ticket(worker))
    else:
        skip = frozenset({first})  # this request could not reach it
    moved = _route(registry, peers, "s", constraint, skip, counters)
    assert moved is not first
    assert counters["session_moves"] == 1
    assert _route(registry, peers, "s", constraint) is moved  # and the key stays where it went


def test_no_worker_for_the_constraint_is_refused_as_for_any_request():
    registry = WorkerRegistry()
    ready(registry, "http://w0:1", 3)
    with pytest.raises(VersionNotReady):
        _route(registry, SoleRouter(registry), "s", VersionConstraint(min_version=9))


def test_routing_key_header_is_checked():
    assert routing_key({}) is None
    assert routing_key({"x-smg-routing-key": " abc "}) == "abc"
    for bad in ("", "   ", "x" * 300, "a\x00b"):
        with pytest.raises(InvalidInput, match="x-smg-routing-key"):
            routing_key({"x-smg-routing-key": bad})
    assert version_extra_key(None) == "weight-version:0" and version_extra_key(7) == "weight-version:7"


def test_the_local_map_is_bounded_least_recently_used_first():
    keys = LocalAffinity(capacity=2)
    keys.put("a", 1)
    keys.put("b", 2)
    assert keys.get("a") == 1
    keys.put("c", 3)
    assert len(keys) == 2 and keys.get("b") is None and keys.get("a") == 1


def test_processes_of_one_router_share_their_keys(tmp_path: Path):
    table = SharedTable.create(tmp_path / "table", 2)
    try:
        leader = LeaderPeers(WorkerRegistry(), table)
        for i in range(3):
            ready(leader.registry, f"http://w{i}:1", 3)
        follower = FollowerPeers(WorkerRegistry(), SharedTable.attach(tmp_path / "table"), 1, hint=lambda _: None)
        follower.sync()
        placed = _route(follower.registry, follower, "session-x")  # the follower places the session
        for _ in range(4):
            leader.registry.acquire(leader.registry.get(placed.url))
        assert _route(leader.registry, leader, "session-x").url == placed.url  # the leader sends it there too
        leader.registry.set_admin_state(placed.url, "paused")  # the leader moves it ...
        moved = _route(leader.registry, leader, "session-x")
        follower.sync()
        assert moved.url != placed.url and _route(follower.registry, follower, "session-x").url == moved.url
    finally:
        table.close()


def test_shared_entries_are_whole_and_tagged(tmp_path: Path):
    """A key whose hash shares an entry with another's reads nothing, never the other's worker."""
    table = SharedTable.create(tmp_path / "t", 1)
    try:
        h = key_hash("one")
        table.set_affinity_slot(h, 7)
        assert table.affinity_slot(h) == 7
        assert table.affinity_slot(h + AFFINITY_SLOTS * 2**20) is None  # same entry, another tag
        assert table.affinity_slot(key_hash("two")) is None
    finally:
        table.close()
