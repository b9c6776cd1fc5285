"""What a router process shares with the router's other processes (``--router-workers N``).

The :class:`~miles_disagg.router.proxy.Router` calls its ``peers`` at five points of the hot path (and, for a
request with a routing key, a sixth: :meth:`SoleRouter.session_worker` / :meth:`SoleRouter.remember_session`,
session affinity, :mod:`~miles_disagg.router.affinity`): before
each routing decision (:meth:`sync`), when a worker's answer shows a version (:meth:`observe_version`),
when a request fails on a worker (:meth:`mark_failed`), when a worker's load changes (:meth:`load_changed`)
and when a request's routing overhead is known (:meth:`record_overhead`); and the registry endpoints read
the totals through it (:meth:`worker_json`, :meth:`metrics`, :meth:`health`).

* :class:`SoleRouter` (the default): the router is one process; its registry is the only view.
* :class:`LeaderPeers`: process 0 of N. It probes the workers and takes the registry calls; every change
  of what routing reads of a worker is written to the shared table
  (:mod:`~miles_disagg.router.shared_table`) in the same step as the registry change, so no process,
  the leader included, routes on a change before every other process can see it. It applies the
  followers' news (a failure, a version seen in an answer) to its registry, which publishes it.
* :class:`FollowerPeers`: process 1..N-1. Its registry is a copy of the table's workers, brought up to
  date before every routing decision (:meth:`FollowerPeers.sync`); it never changes a worker's version
  or health itself beyond taking a failed worker out of its own routing at once: it sends the news to the
  leader (``hint``), whose table entry then decides for every process. A version seen in an answer is thus
  routed on only once the leader has published it, by all processes alike (no process serves a request
  that needs version V on a worker the others still think older, and none answers 409 for it after the
  leader published it).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable

from miles_disagg.router.affinity import GONE, LiveSessions, LocalAffinity, key_hash
from miles_disagg.router.registry import Worker, WorkerRegistry, WorkerState, normalize_url
from miles_disagg.router.shared_table import (ANSWERED, APPLIED_SEQ, BUSY_S, BUSY_SINCE, CAPACITY, COUNTERS, IN_FLIGHT,
                                              LAST_ANSWER, PID, SERVING, URL_BYTES, SharedTable, SlotRecord, bucket_of,
                                              histogram_percentiles_ms)
from miles_disagg.types import InvalidInput

log = logging.getLogger(__name__)


class SoleRouter:
    """The router is one process: its registry is the only view; nothing is shared."""

    def __init__(self, registry: WorkerRegistry):
        self.registry = registry
        self.sessions = LocalAffinity()
        self.live_sessions = LiveSessions()
        """Sessions per worker that this process routed lately (where new sessions go: router/affinity.py)."""

    def session_worker(self, key: str) -> Worker | object | None:
        """The worker that served routing key ``key`` last (:mod:`~miles_disagg.router.affinity`): None for a
        new key, ``GONE`` when that worker left the registry."""
        worker = self.sessions.get(key)
        return worker if worker is None or self.registry.contains(worker) else GONE

    def remember_session(self, key: str, worker: Worker) -> None:
        self.sessions.put(key, worker)

    def sync(self) -> None:
        """Bring this process's view up to date (nothing to do here)."""

    def observe_version(self, worker: Worker, version: int | None) -> None:
        self.registry.observe_version(worker, version)

    def mark_failed(self, worker: Worker, reason: str) -> None:
        self.registry.mark_failed(worker, reason)

    def load_changed(self, worker: Worker) -> None:
        """``worker``'s in-flight count (or its answered count) just changed in this process."""

    def record_overhead(self, seconds: float) -> None:
        """One request's routing overhead (the single process keeps its own window in the router)."""

    def check_admission(self, url: str) -> None:
        """``InvalidInput`` when ``url`` cannot be registered (never, for one process)."""

    def last_answer_at(self, worker: Worker) -> float | None:
        """When any process of the router last had an answer from ``worker`` (``time.monotonic``)."""
        return worker.last_answer_at

    def worker_json(self, worker: Worker) -> dict[str, Any]:
        return worker.to_json()

    def metrics(self, own: dict[str, Any]) -> dict[str, Any]:
        """``/metrics`` from this process's own figures."""
        return own

    def health(self, own: dict[str, Any]) -> dict[str, Any]:
        return own


class _SharedPeers(SoleRouter):
    """What the leader and the followers both do: write their own load column and overhead histogram."""

    def __init__(self, registry: WorkerRegistry, table: SharedTable, rank: int):
        super().__init__(registry)
        self.table, self.rank = table, rank
        self.slot_of: dict[Worker, int] = {}
        self._floats = table.floats
        self._hist_at = table.hist_index(rank)

    def load_changed(self, worker: Worker) -> None:
        slot = self.slot_of.get(worker)
        if slot is None:
            return  # not (or no longer) in the table: nobody reads its load
        at, floats = self.table.stat_index(self.rank, slot), self._floats
        floats[at + IN_FLIGHT] = worker.outstanding
        floats[at + ANSWERED] = worker.num_served
        floats[at + BUSY_S] = worker.busy_s
        floats[at + BUSY_SINCE] = worker.busy_since or 0.0
        floats[at + LAST_ANSWER] = worker.last_answer_at or 0.0

    def record_overhead(self, seconds: float) -> None:
        self._floats[self._hist_at + bucket_of(seconds)] += 1

    def session_worker(self, key: str) -> Worker | object | None:
        """From the shared affinity table: whichever process routed ``key`` last recorded it there."""
        slot = self.table.affinity_slot(key_hash(key))
        if slot is None:
            return None
        worker = self.worker_at(slot)
        return GONE if worker is None else worker

    def remember_session(self, key: str, worker: Worker) -> None:
        slot = self.slot_of.get(worker)
        if slot is not None:
            self.table.set_affinity_slot(key_hash(key), slot)

    def worker_at(self, slot: int) -> Worker | None:
        raise NotImplementedError

    def publish_counters(self, counters: dict[str, int]) -> None:
        for name in COUNTERS:
            self._floats[self.table.counter_index(self.rank, name)] = counters.get(name, 0)


class LeaderPeers(_SharedPeers):
    """Process 0: publishes its registry's changes to the table; applies the followers' news."""

    def __init__(self, registry: WorkerRegistry, table: SharedTable):
        super().__init__(registry, table, 0)
        self._written: dict[int, SlotRecord] = {}
        self._at_slot: dict[int, Worker] = {}
        self._freed: list[tuple[int, int]] = []  # (slot, the table's sequence number once it was freed)
        self._next_slot = 0
        registry.listener = self._publish
        table.set_proc(0, PID, float(os.getpid()))
        table.set_proc(0, SERVING, 1.0)

    # ------------------------------------------------------------------ publishing

    def check_admission(self, url: str) -> None:
        url = normalize_url(url)
        try:
            self.registry.get(url)
            return  # registered already: adding it again changes nothing
        except InvalidInput:
            pass
        if len(url.encode()) > URL_BYTES:
            raise InvalidInput(f"a router of several processes takes worker URLs of at most {URL_BYTES} bytes, "
                               f"got {len(url.encode())}")
        if self._next_slot >= CAPACITY and self._reusable() is None:
            raise InvalidInput(f"a router of several processes holds at most {CAPACITY} workers; remove one first")

    def _publish(self, worker: Worker, removed: bool) -> None:
        """The registry's listener: write what routing reads of ``worker`` (or free its slot)."""
        if removed:
            slot = self.slot_of.pop(worker, None)
            if slot is not None:
                self._at_slot.pop(slot, None)
                self.table.write(SlotRecord(slot, False))
                self._written.pop(slot, None)
                self._freed.append((slot, self.table.seq))
            return
        if not self.registry.contains(worker):
            return  # news of a worker removed meanwhile (a probe that was out when it left)
        slot = self.slot_of.get(worker)
        if slot is None:
            slot = self.slot_of[worker] = self._allocate()
            self._at_slot[slot] = worker
            self.table.clear_load(0, slot)
        record = SlotRecord(slot, True, worker.url, worker.admin_state.value, worker.ever_healthy, worker.unhealthy,
                            worker.weight_version, worker.run_id, worker.failure_seq,
                            tuple(sorted(worker.older_versions.items())))
        if self._written.get(slot) != record:
            self.table.write(record)
            self._written[slot] = record

    def worker_at(self, slot: int) -> Worker | None:
        return self._at_slot.get(slot)

    def _reusable(self) -> int | None:
        """A freed slot every live process has seen freed (so none still counts load in it), if any."""
        live = [p for p in range(1, self.table.processes) if self.table.proc(p, PID)]
        applied = min((self.table.proc(p, APPLIED_SEQ) for p in live), default=float("inf"))
        for index, (slot, freed_at) in enumerate(self._freed):
            if freed_at <= applied:
                return index
        return None

    def _allocate(self) -> int:
        index = self._reusable()
        if index is not None:
            return self._freed.pop(index)[0]
        if self._next_slot >= CAPACITY:  # check_admission refuses this before the registry is touched
            raise RuntimeError("router table full")
        self._next_slot += 1
        return self._next_slot - 1

    # ------------------------------------------------------------------ the followers' news

    def apply_hint(self, rank: int, hint: dict[str, Any]) -> None:
        """A follower's news: ``{"op": "failed", "url", "reason"}`` or ``{"op": "version", "url", "version"}``
        (anything else, or an unknown worker, is ignored: the worker may have left meanwhile)."""
        try:
            worker = self.registry.get(hint["url"])
        except (InvalidInput, KeyError, TypeError):
            return
        if hint.get("op") == "failed":
            log.warning("worker %s taken out of routing (router process %d): %s", worker.url, rank, hint.get("reason"))
            self.registry.mark_failed(worker, f"{hint.get('reason')} (router process {rank})")
        elif hint.get("op") == "version" and isinstance(hint.get("version"), int):
            self.registry.observe_version(worker, hint["version"])

    # ------------------------------------------------------------------ totals over every process

    def last_answer_at(self, worker: Worker) -> float | None:
        slot = self.slot_of.get(worker)
        return worker.last_answer_at if slot is None else self.table.load_totals(slot, time.monotonic()).last_answer_at

    def worker_json(self, worker: Worker) -> dict[str, Any]:
        entry = worker.to_json()
        slot = self.slot_of.get(worker)
        if slot is not None:
            totals = self.table.load_totals(slot, time.monotonic())
            entry.update(outstanding=totals.in_flight, num_served=totals.answered, busy_s=round(totals.busy_s, 6))
        return entry

    def serving(self) -> list[int]:
        """The ranks of the processes that serve now (the leader included)."""
        return [p for p in range(self.table.processes) if self.table.proc(p, SERVING)]

    def metrics(self, own: dict[str, Any]) -> dict[str, Any]:
        """Counters summed over the processes, served per worker over them, the overhead percentiles from
        the merged histograms (within 2%), and each process's share."""
        per_process = [{"rank": 0, "pid": int(self.table.proc(0, PID)), "requests": own["requests"]}]
        totals = {name: own[name] for name in COUNTERS}
        for rank in range(1, self.table.processes):
            theirs = self.table.counters(rank)
            per_process.append({"rank": rank, "pid": int(self.table.proc(rank, PID)), "requests": theirs["requests"]})
            totals = {name: totals[name] + theirs[name] for name in COUNTERS}
        served = {w.url: self.worker_json(w)["num_served"] for w in self.registry.workers()}
        return {**own, **totals, "served_per_worker": served,
                "routing_overhead_ms": histogram_percentiles_ms(self.table.merged_histogram()),
                "router_workers": {"configured": self.table.processes, "serving": len(self.serving()),
                                   "per_process": per_process}}

    def health(self, own: dict[str, Any]) -> dict[str, Any]:
        return {**own, "router_workers": {"configured": self.table.processes, "serving": len(self.serving())}}


class FollowerPeers(_SharedPeers):
    """Process ``rank`` >= 1: its registry follows the table; its news go to the leader through ``hint``."""

    def __init__(self, registry: WorkerRegistry, table: SharedTable, rank: int, hint: Callable[[dict], None]):
        super().__init__(registry, table, rank)
        self.hint = hint
        self.applied_seq = 0
        self._bound: dict[int, Worker] = {}
        self._failures: dict[Worker, int] = {}  # the leader's failure count of the worker, as last applied
        self._failed_at: dict[Worker, int] = {}  # failed here while the leader's count was this: out until it moves
        self._hinted: dict[Worker, int] = {}  # the last version sent to the leader per worker

    def sync(self) -> None:
        """Apply every slot the leader wrote since the last call (one read when nothing changed)."""
        if self.table.seq == self.applied_seq:
            return
        self.applied_seq, records = self.table.changes_since(self.applied_seq)
        for record in records:  # first what left (a URL may have moved to another slot), then what is there
            worker = self._bound.get(record.slot)
            if worker is not None and (not record.present or worker.url != record.url):
                self._unbind(record.slot, worker)
        for record in records:
            if record.present:
                self._apply(record)
        self.table.set_proc(self.rank, APPLIED_SEQ, float(self.applied_seq))

    def worker_at(self, slot: int) -> Worker | None:
        return self._bound.get(slot)

    def _unbind(self, slot: int, worker: Worker) -> None:
        del self._bound[slot]
        del self.slot_of[worker]
        for bookkeeping in (self._failures, self._failed_at, self._hinted):
            bookkeeping.pop(worker, None)
        if self.registry.contains(worker):
            self.registry.remove(worker.url)  # its requests in flight finish normally

    def _apply(self, record: SlotRecord) -> None:
        worker = self._bound.get(record.slot)
        if worker is None:
            worker = self.registry.add(record.url)
            self._bound[record.slot], self.slot_of[worker] = worker, record.slot
            self.table.clear_load(self.rank, record.slot)
        unhealthy = record.unhealthy
        failed_at = self._failed_at.get(worker)
        if failed_at is not None:
            if record.failures > failed_at:
                del self._failed_at[worker]  # the leader has it (or a later word on it): follow the leader
            else:
                unhealthy = True
        self._failures[worker] = record.failures
        self.registry.assign(worker, admin_state=WorkerState(record.admin_state), weight_version=record.weight_version,
                             run_id=record.run_id, ever_healthy=record.ever_healthy, unhealthy=unhealthy,
                             older_versions=dict(record.older_versions))

    def observe_version(self, worker: Worker, version: int | None) -> None:
        """Never applied here: the leader publishes it for every process at once."""
        if (version is None or version == worker.weight_version or version in worker.older_versions
                or self._hinted.get(worker) == version):
            return
        self._hinted[worker] = version
        self.hint({"op": "version", "url": worker.url, "version": version})

    def mark_failed(self, worker: Worker, reason: str) -> None:
        """Out of this process's routing at once; out of every process's once the leader publishes it."""
        self.registry.mark_failed(worker, reason)
        if worker in self.slot_of:
            self._failed_at[worker] = self._failures.get(worker, 0)
            self.hint({"op": "failed", "url": worker.url, "reason": reason})
