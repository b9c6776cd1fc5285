"""The router's load index (registry buckets by outstanding count) and ``choose_in``: the same rule as
the full pass of ``choose`` (fewest outstanding among eligible workers, ties in turn), pinned against it
over random sequences of loads, states, versions and memberships."""

from __future__ import annotations

import random

import pytest

from miles_disagg.router.policy import LeastOutstandingPolicy, NoWorkerAvailable
from miles_disagg.router.registry import WorkerRegistry, WorkerState
from miles_disagg.types import VersionConstraint, VersionNotReady

ANY = VersionConstraint()


def ready_registry(count: int, version: int | None = 1) -> WorkerRegistry:
    registry = WorkerRegistry()
    for i in range(count):
        worker = registry.add(f"http://w{i}:1")
        registry.record_probe_ok(worker, version, registry.ticket(worker))
    return registry


def eligible(registry: WorkerRegistry, constraint: VersionConstraint):
    return [w for w in registry.workers() if w.state is WorkerState.READY
            and (constraint.allows(w.weight_version, w.run_id) if w.weight_version is not None
                 else constraint == ANY)]


def test_ties_rotate_without_dispatch():
    registry = ready_registry(3)
    policy = LeastOutstandingPolicy()
    assert [policy.choose_in(registry, ANY).url for _ in range(6)] == [f"http://w{i % 3}:1" for i in range(6)]


def test_dispatch_spreads_evenly_and_prefers_the_least_loaded():
    registry = ready_registry(4)
    policy = LeastOutstandingPolicy()
    for _ in range(8):
        registry.acquire(policy.choose_in(registry, ANY))
    assert [w.outstanding for w in registry.workers()] == [2, 2, 2, 2]
    w2 = registry.workers()[2]
    registry.release(w2, served=True)
    assert policy.choose_in(registry, ANY) is w2


def test_removed_worker_with_requests_in_flight_is_never_chosen_and_readding_starts_at_zero():
    registry = ready_registry(2)
    policy = LeastOutstandingPolicy()
    w0 = registry.workers()[0]
    registry.acquire(w0)
    registry.remove(w0.url)
    registry.release(w0, served=True)  # its request ends after the removal
    assert {policy.choose_in(registry, ANY).url for _ in range(3)} == {"http://w1:1"}
    again = registry.add(w0.url)
    assert again is not w0 and again.outstanding == 0
    assert [w.url for w in registry.by_load()] == ["http://w1:1", "http://w0:1"]


@pytest.mark.parametrize("how", ["paused", "unhealthy"])
def test_idle_workers_out_of_routing_are_skipped(how):
    registry = ready_registry(3)
    w0, w1, w2 = registry.workers()
    registry.acquire(w2)
    if how == "paused":
        registry.set_admin_state(w0.url, "paused")
    else:
        registry.mark_failed(w0, "boom")
    assert LeastOutstandingPolicy().choose_in(registry, ANY) is w1


def test_refusals_match_the_full_pass():
    registry = ready_registry(2, version=3)
    policy = LeastOutstandingPolicy()
    with pytest.raises(VersionNotReady):
        policy.choose_in(registry, VersionConstraint(min_version=4))
    for worker in registry.workers():
        registry.set_admin_state(worker.url, "paused")
    with pytest.raises(NoWorkerAvailable):
        policy.choose_in(registry, ANY)
    with pytest.raises(NoWorkerAvailable):
        policy.choose_in(WorkerRegistry(), ANY)


@pytest.mark.parametrize("seed", range(5))
def test_choice_is_always_a_least_loaded_eligible_worker(seed):
    rng = random.Random(seed)
    registry = ready_registry(12)
    policy = LeastOutstandingPolicy()
    constraints = [ANY, VersionConstraint(min_version=2), VersionConstraint(exact_version=1),
                   VersionConstraint(min_version=9)]
    in_flight = []
    for step in range(600):
        action = rng.random()
        workers = registry.workers()
        if action < 0.45:
            constraint = rng.choice(constraints)
            candidates = eligible(registry, constraint)
            if not candidates:
                with pytest.raises((NoWorkerAvailable, VersionNotReady)):
                    policy.choose_in(registry, constraint)
                continue
            chosen = policy.choose_in(registry, constraint)
            assert chosen in candidates, step
            assert chosen.outstanding == min(w.outstanding for w in candidates), step
            registry.acquire(chosen)
            in_flight.append(chosen)
        elif action < 0.8 and in_flight:
            registry.release(in_flight.pop(rng.randrange(len(in_flight))), served=True)
        elif action < 0.88 and workers:
            worker = rng.choice(workers)
            registry.set_admin_state(worker.url, rng.choice(["ready", "paused", "activating"]))
        elif action < 0.94 and workers:
            worker = rng.choice(workers)
            registry.record_probe_ok(worker, rng.choice([None, 1, 2, 3]), registry.ticket(worker))
        elif action < 0.97 and workers:
            registry.remove(rng.choice(workers).url)
        else:
            worker = registry.add(f"http://w{rng.randrange(16)}:1")
            registry.record_probe_ok(worker, 1, registry.ticket(worker))
        assert sorted(w.url for w in registry.by_load()) == sorted(w.url for w in registry.workers())
        loads = [w.outstanding for w in registry.by_load()]
        assert loads == sorted(loads)
