"""Worker registry: states from probes and admin marks, versions, load counts."""

from __future__ import annotations

import pytest

from miles_disagg.router.registry import (UnknownWorker, WorkerRegistry, WorkerState, normalize_url,
                                          parse_version)
from miles_disagg.types import InvalidInput

URL = "http://127.0.0.1:9000"


def healthy_worker(registry: WorkerRegistry, version: int | None = 0, url: str = URL):
    worker = registry.add(url)
    registry.record_probe_ok(worker, version, registry.ticket(worker))
    return worker


@pytest.mark.parametrize("value,expected", [
    (3, 3), ("3", 3), ("0", 0), ("007", 7), (0, 0),
    ("default", None), ("", None), ("-1", None), (-1, None), (True, None), (None, None), ("1.5", None),
    ("٣", None), (2.0, None),
])
def test_parse_version(value, expected):
    assert parse_version(value) == expected


@pytest.mark.parametrize("url,expected", [
    ("http://h:1", "http://h:1"), ("http://h:1/", "http://h:1"), ("h:1", "http://h:1"),
    (" https://h:1 ", "https://h:1"),
])
def test_normalize_url(url, expected):
    assert normalize_url(url) == expected


@pytest.mark.parametrize("url", ["", None, "ftp://h:1", "http://", "http://h:1/generate", 5])
def test_normalize_url_rejects(url):
    with pytest.raises(InvalidInput):
        normalize_url(url)


def test_add_is_idempotent_and_keeps_registration_order():
    registry = WorkerRegistry()
    first = registry.add("h:1")
    registry.add("http://h:2")
    assert registry.add("http://h:1/") is first
    assert [w.url for w in registry.workers()] == ["http://h:1", "http://h:2"]
    assert first.state is WorkerState.STARTING and not first.healthy


def test_remove_and_unknown_worker():
    registry = WorkerRegistry()
    registry.add(URL)
    assert registry.remove(URL + "/").url == URL
    assert registry.workers() == []
    with pytest.raises(UnknownWorker):
        registry.remove(URL)
    with pytest.raises(UnknownWorker):
        registry.set_admin_state(URL, "paused")


def test_first_successful_probe_makes_ready_with_version():
    registry = WorkerRegistry()
    worker = healthy_worker(registry, version=4)
    assert (worker.state, worker.weight_version, worker.healthy) == (WorkerState.READY, 4, True)
    assert worker.to_json() == {"url": URL, "weight_version": 4, "run_id": None, "state": "ready", "outstanding": 0,
                                "healthy": True, "last_error": None, "num_served": 0, "busy_s": 0.0}


def test_never_healthy_worker_stays_starting_with_its_error():
    registry = WorkerRegistry(failure_threshold=1)
    worker = registry.add(URL)
    registry.record_probe_failure(worker, "refused", definite=True)
    assert worker.state is WorkerState.STARTING and worker.last_error == "refused"


def test_definite_failure_takes_out_at_once_timeouts_need_threshold():
    registry = WorkerRegistry(failure_threshold=3)
    worker = healthy_worker(registry)
    registry.record_probe_failure(worker, "timeout", definite=False)
    registry.record_probe_failure(worker, "timeout", definite=False)
    assert worker.state is WorkerState.READY and not worker.healthy
    registry.record_probe_failure(worker, "timeout", definite=False)
    assert worker.state is WorkerState.UNHEALTHY

    other = healthy_worker(registry, url="http://h:2")
    registry.record_probe_failure(other, "refused", definite=True)
    assert other.state is WorkerState.UNHEALTHY


def test_recovery_reads_fresh_version_and_returns_to_admin_state():
    registry = WorkerRegistry()
    worker = healthy_worker(registry, version=1)
    registry.set_admin_state(URL, "paused")
    registry.mark_failed(worker, "connection reset")
    assert worker.state is WorkerState.UNHEALTHY and worker.last_error == "connection reset"
    registry.record_probe_ok(worker, 2, registry.ticket(worker))
    assert (worker.state, worker.weight_version, worker.last_error) == (WorkerState.PAUSED, 2, None)
    registry.set_admin_state(URL, WorkerState.READY)
    assert worker.state is WorkerState.READY


def test_probe_result_is_ignored_when_a_failure_happened_during_the_probe():
    registry = WorkerRegistry()
    worker = healthy_worker(registry)
    ticket = registry.ticket(worker)
    registry.mark_failed(worker, "502 while proxying")
    registry.record_probe_ok(worker, 0, ticket)
    assert worker.state is WorkerState.UNHEALTHY


def test_slow_probe_does_not_roll_back_a_newer_version():
    registry = WorkerRegistry()
    worker = healthy_worker(registry, version=1)
    ticket = registry.ticket(worker)
    registry.observe_version(worker, 2)  # a response finished on the updated engine meanwhile
    registry.record_probe_ok(worker, 1, ticket)  # read before the update
    assert worker.weight_version == 2
    registry.record_probe_ok(worker, 0, registry.ticket(worker))  # a fresh probe is authoritative
    assert worker.weight_version == 0


def test_responses_only_move_the_version_forward():
    registry = WorkerRegistry()
    worker = healthy_worker(registry, version=None)
    registry.observe_version(worker, 3)
    registry.observe_version(worker, 2)
    registry.observe_version(worker, None)
    assert worker.weight_version == 3


def test_set_admin_state_validates_and_may_set_version():
    registry = WorkerRegistry()
    worker = healthy_worker(registry, version=1)
    for bad in ("unhealthy", "starting", "bogus", None):
        with pytest.raises(InvalidInput):
            registry.set_admin_state(URL, bad)
    registry.set_admin_state(URL, "activating", weight_version=5)
    assert (worker.state, worker.weight_version) == (WorkerState.ACTIVATING, 5)


def test_acquire_release_counts():
    registry = WorkerRegistry()
    worker = healthy_worker(registry)
    registry.acquire(worker)
    registry.acquire(worker)
    assert worker.outstanding == 2
    registry.release(worker, served=True)
    registry.release(worker, served=False)
    assert (worker.outstanding, worker.num_served) == (0, 1)


def test_threshold_must_be_positive():
    with pytest.raises(ValueError):
        WorkerRegistry(failure_threshold=0)


def test_busy_seconds_count_only_time_with_requests_in_flight(monkeypatch) -> None:
    import miles_disagg.router.registry as registry_module

    clock = [100.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: clock[0])
    registry = WorkerRegistry()
    worker = healthy_worker(registry, version=0)
    registry.acquire(worker)
    clock[0] = 101.0
    registry.acquire(worker)  # overlapping requests do not double-count
    clock[0] = 102.0
    registry.release(worker, served=True)
    assert worker.busy_seconds() == 2.0
    registry.release(worker, served=True)
    clock[0] = 110.0  # idle time is not busy time
    assert worker.busy_seconds() == 2.0
