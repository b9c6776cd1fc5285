"""Health probes whose cost does not grow per request with the pool: a pass skips a ready worker that
answered a proxied request recently (at most :data:`MAX_SKIPPED_PASSES` passes in a row), never one whose
answer contradicted its known version, nor one that is paused, starting or unhealthy."""

from __future__ import annotations

import time

from registry_workers import answer_one, ready

from miles_disagg.router.health import MAX_SKIPPED_PASSES, HealthChecker
from miles_disagg.router.registry import WorkerRegistry


def test_a_pass_skips_ready_workers_that_answered_within_the_window_and_no_others():
    registry = WorkerRegistry()
    busy, quiet, paused = (ready(registry, f"http://{name}:1") for name in ("busy", "quiet", "paused"))
    for worker in (busy, paused):
        answer_one(registry, worker)
    registry.set_admin_state(paused.url, "paused")
    starting = registry.add("http://starting:1")
    checker = HealthChecker(registry, client=None, interval_s=1.0)
    assert checker.due(registry.workers(), within_s=5.0) == [quiet, paused, starting]
    busy.last_answer_at = time.monotonic() - 6.0  # outside the window
    assert busy in checker.due(registry.workers(), within_s=5.0)


def test_a_busy_worker_is_still_probed_every_few_passes():
    registry = WorkerRegistry()
    worker = ready(registry, "http://a:1")
    checker = HealthChecker(registry, client=None, interval_s=1.0)
    probed = []
    for _ in range(2 * (MAX_SKIPPED_PASSES + 1)):
        answer_one(registry, worker)
        probed.append(bool(checker.due([worker], within_s=5.0)))
    assert probed == ([False] * MAX_SKIPPED_PASSES + [True]) * 2


def test_an_answer_with_an_older_version_makes_the_next_probe_due():
    registry = WorkerRegistry()
    worker = ready(registry, "http://a:1", version=4)
    answer_one(registry, worker)
    registry.observe_version(worker, 3)  # e.g. an engine restarted from an older version
    assert worker.weight_version == 4 and worker.probe_due
    checker = HealthChecker(registry, client=None, interval_s=1.0)
    assert checker.due([worker], within_s=5.0) == [worker]
    registry.record_probe_ok(worker, 3, registry.ticket(worker))  # the probe reads what it holds
    assert worker.weight_version == 3 and not worker.probe_due
    assert checker.due([worker], within_s=5.0) == []


def test_the_last_answer_may_come_from_elsewhere():
    registry = WorkerRegistry()
    worker = ready(registry, "http://a:1")
    checker = HealthChecker(registry, client=None, interval_s=1.0, last_answer=lambda w: time.monotonic())
    assert checker.due([worker], within_s=5.0) == []  # another router process had its answer
