"""Session affinity (``X-SMG-Routing-Key``): a key stays on the worker that served it last while that
worker can take it, moves (counted) when it cannot; one process keeps keys in a bounded map, several
processes in their shared table, so any process routes a key where another one sent it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from registry_workers import ready

from miles_disagg.router.affinity import (LiveSessions, LocalAffinity, choose_for_session, key_hash, routing_key,
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


def test_new_sessions_go_where_the_fewest_live_sessions_are_not_the_fewest_requests():
    """Sessions between turns have no request out: fewest outstanding alone would put every new session
    on the engine whose sessions all wait on their tools."""
    registry = WorkerRegistry()
    workers = [ready(registry, f"http://w{i}:1", 3) for i in range(2)]
    peers = SoleRouter(registry)
    placed = [_route(registry, peers, f"s{i}") for i in range(4)]  # none has a request out: 2 on each
    assert Counter(w.url for w in placed) == {w.url: 2 for w in workers}
    busy = next(w for w in workers if w is not placed[0])
    for _ in range(3):
        registry.acquire(busy)  # its sessions' turns are running; the other worker's sessions wait on tools
    assert _route(registry, peers, "s4") is not busy  # fewer requests out ...
    assert _route(registry, peers, "s5") is busy  # ... but now more sessions: the next one goes to the busy one
    assert [_route(registry, peers, f"s{i}") for i in range(4)] == placed  # each key stays where it was


def test_live_sessions_lapse_after_their_window_and_only_steer_placement():
    now = [0.0]
    live = LiveSessions(live_s=10.0, clock=lambda: now[0])
    live.touch("a", "w0")
    live.touch("b", "w0")
    live.touch("a", "w1")  # a moved
    assert (live.held_by("w0"), live.held_by("w1")) == (1, 1)
    now[0] = 8.0
    live.touch("a", "w1")
    now[0] = 12.0  # b last routed 12 s ago, a 4 s ago
    assert (live.held_by("w0"), live.held_by("w1")) == (0, 1)
    bounded = LiveSessions(capacity=2, clock=lambda: 0.0)
    for key in "xyz":
        bounded.touch(key, "w")
    assert bounded.held_by("w") == 2


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
