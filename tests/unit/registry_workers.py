"""Workers put into a router's :class:`~miles_disagg.router.registry.WorkerRegistry` in a known state,
for the router's unit tests."""

from __future__ import annotations

from miles_disagg.router.registry import WorkerRegistry


def ready(registry: WorkerRegistry, url: str, version: int | None = 1):
    """``url`` added and probed once, answering ``version``: ready."""
    worker = registry.add(url)
    registry.record_probe_ok(worker, version, registry.ticket(worker))
    return worker


def answer_one(registry: WorkerRegistry, worker) -> None:
    """``worker`` served one proxied request."""
    registry.acquire(worker)
    registry.release(worker, served=True)
