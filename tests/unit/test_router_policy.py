"""Routing policy and request-constraint parsing: pure, no sockets."""

from __future__ import annotations

import pytest

from miles_disagg.router.policy import annotate_served_versions, violates
from miles_disagg.router.policy import LeastOutstandingPolicy, NoWorkerAvailable, request_constraint, satisfies
from miles_disagg.router.registry import WorkerRegistry
from miles_disagg.types import InvalidInput, VersionConstraint, VersionNotReady

ANY = VersionConstraint()


def make_registry(*versions: int | None) -> WorkerRegistry:
    """One ready worker per version, at http://w0, http://w1, ..."""
    registry = WorkerRegistry()
    for i, version in enumerate(versions):
        worker = registry.add(f"http://w{i}:1")
        registry.record_probe_ok(worker, version, registry.ticket(worker))
    return registry


def choose_url(registry: WorkerRegistry, constraint: VersionConstraint, policy=None) -> str:
    return (policy or LeastOutstandingPolicy()).choose(registry.workers(), constraint).url


@pytest.mark.parametrize("version,constraint,expected", [
    (3, ANY, True), (None, ANY, True),
    (3, VersionConstraint(min_version=3), True), (2, VersionConstraint(min_version=3), False),
    (4, VersionConstraint(exact_version=3), False), (3, VersionConstraint(exact_version=3), True),
    (None, VersionConstraint(min_version=0), False), (None, VersionConstraint(exact_version=0), False),
])
def test_satisfies(version, constraint, expected):
    assert satisfies(version, constraint) is expected


def test_min_constraint_never_picks_an_older_worker_even_if_idle():
    registry = make_registry(1, 3)
    registry.acquire(registry.workers()[1])
    registry.acquire(registry.workers()[1])
    policy = LeastOutstandingPolicy()
    assert {choose_url(registry, VersionConstraint(min_version=2), policy) for _ in range(4)} == {"http://w1:1"}


def test_exact_constraint_picks_exactly_that_version():
    registry = make_registry(4, 3, 5)
    assert choose_url(registry, VersionConstraint(exact_version=3)) == "http://w1:1"


def test_least_outstanding_wins():
    registry = make_registry(0, 0, 0)
    w0, w1, w2 = registry.workers()
    for worker, load in ((w0, 2), (w1, 1), (w2, 3)):
        for _ in range(load):
            registry.acquire(worker)
    assert choose_url(registry, ANY) == w1.url


def test_ties_rotate_round_robin():
    registry = make_registry(0, 0, 0)
    policy = LeastOutstandingPolicy()
    assert [choose_url(registry, ANY, policy) for _ in range(6)] == [f"http://w{i % 3}:1" for i in range(6)]


@pytest.mark.parametrize("how", ["paused", "activating", "unhealthy", "starting"])
def test_only_ready_workers_are_routed_to(how):
    registry = make_registry(2, 2)
    w0, _ = registry.workers()
    if how == "unhealthy":
        registry.mark_failed(w0, "boom")
    elif how == "starting":
        registry.remove(w0.url)
        registry.add(w0.url)
    else:
        registry.set_admin_state(w0.url, how)
    policy = LeastOutstandingPolicy()
    assert {choose_url(registry, ANY, policy) for _ in range(4)} == {"http://w1:1"}


def test_unknown_version_serves_only_unconstrained():
    registry = make_registry(None)
    assert choose_url(registry, ANY) == "http://w0:1"
    with pytest.raises(VersionNotReady) as info:
        choose_url(registry, VersionConstraint(min_version=0))
    assert info.value.available == []


def test_version_not_ready_lists_ready_versions():
    registry = make_registry(2, 1, 2)
    registry.set_admin_state("http://w2:1", "paused")
    registry.set_admin_state("http://w1:1", "ready", weight_version=0)
    with pytest.raises(VersionNotReady) as info:
        choose_url(registry, VersionConstraint(exact_version=5))
    assert info.value.available == [0, 2]
    assert info.value.constraint == VersionConstraint(exact_version=5)


def test_no_worker_available():
    with pytest.raises(NoWorkerAvailable, match="no workers are registered"):
        choose_url(WorkerRegistry(), ANY)
    registry = make_registry(1)
    registry.set_admin_state("http://w0:1", "paused")
    with pytest.raises(NoWorkerAvailable) as info:
        choose_url(registry, VersionConstraint(min_version=1))
    assert info.value.states == {"paused": 1}


# --------------------------------------------------------------------------- request constraints


@pytest.mark.parametrize("body,headers,expected", [
    ({}, {}, ANY),
    ({"weight_version": None}, {}, ANY),
    ({"weight_version": {"min_version": 2}}, {}, VersionConstraint(min_version=2)),
    ({"weight_version": {"exact_version": 0}}, {}, VersionConstraint(exact_version=0)),
    ({}, {"x-weight-version-min": "3"}, VersionConstraint(min_version=3)),
    ({}, {"x-weight-version-exact": " 4 "}, VersionConstraint(exact_version=4)),
    ({"weight_version": {"min_version": 2}}, {"x-weight-version-min": "2"}, VersionConstraint(min_version=2)),
])
def test_constraint_from_body_or_headers(body, headers, expected):
    assert request_constraint(body, headers) == expected
    assert "weight_version" not in body  # stripped before forwarding


@pytest.mark.parametrize("body,headers", [
    ({"weight_version": 3}, {}),
    ({"weight_version": {"min_version": -1}}, {}),
    ({"weight_version": {"min_version": 1, "exact_version": 1}}, {}),
    ({"weight_version": {"newest": True}}, {}),
    ({}, {"x-weight-version-min": "default"}),
    ({}, {"x-weight-version-min": "1", "x-weight-version-exact": "1"}),
    ({"weight_version": {"min_version": 1}}, {"x-weight-version-exact": "1"}),
])
def test_malformed_constraints_are_invalid_input(body, headers):
    with pytest.raises(InvalidInput):
        request_constraint(body, headers)


def test_annotate_prefers_engine_start_end_and_falls_back_to_dispatch_version():
    registry = make_registry(6)
    worker = registry.workers()[0]
    engine_meta = {"weight_version": "6", "weight_version_start": "5", "weight_version_end": "6"}
    assert annotate_served_versions(engine_meta, 4, worker) == 5
    assert (engine_meta["weight_version_start"], engine_meta["weight_version_end"]) == (5, 6)
    sglang_meta = {"weight_version": "6"}
    assert annotate_served_versions(sglang_meta, 4, worker) == 4
    assert sglang_meta == {"weight_version": "6", "weight_version_start": 4, "weight_version_end": 6,
                           "routed_worker": worker.url}
    unknown = {"weight_version": "default"}
    assert annotate_served_versions(unknown, None, worker) is None and unknown["weight_version_end"] is None


@pytest.mark.parametrize("start,end,constraint,expected", [
    (3, 3, VersionConstraint(min_version=3), False),
    (3, 4, VersionConstraint(exact_version=3), False),  # updated mid-request: reported, not refused
    (2, 3, VersionConstraint(min_version=3), True),
    (4, 2, VersionConstraint(min_version=3), True),  # start inferred by the router, engine says older
    (4, 4, VersionConstraint(exact_version=3), True),
    (None, None, ANY, False), (None, None, VersionConstraint(min_version=0), True),
])
def test_violates(start, end, constraint, expected):
    assert violates(start, end, constraint) is expected
