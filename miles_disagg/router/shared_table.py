"""The memory a router's processes share (``--router-workers N``): the workers' routing state, and each process's load.

One file on a RAM-backed file system (``/dev/shm`` where there is one), mapped by every process of the router:

* **Slots** (:data:`CAPACITY`): one per registered worker, written only by the leader (the process that
  probes and takes the registry calls): URL, admin state, health, weight version, run id, the older LoRA
  adapter versions it keeps resident (their JSON) and the count of failures it recorded. Each write appends the slot's index to a **change ring** and then bumps the
  table's **sequence number**, all under the table's lock (``flock`` on the file).
* A reader (every process that routes) compares the sequence number with the last one it applied before
  each routing decision (one 8-byte read) and, when it moved, reads the changed slots under the lock
  (all slots when it fell more than :data:`RING` changes behind). So a change the leader made is seen by
  every process before its next routing decision: none routes on a view older than what another one
  routes on, beyond the request it is deciding at that instant.
* **Load columns**: per process and slot, its requests in flight, answered, busy seconds and the time of
  its last answer, written only by that process (no lock: single writer, 8-byte aligned values); the
  leader sums them for ``/list_workers`` and skips probes of workers that answered within the interval.
* **Process rows**: per process its pid, whether it serves, the last sequence number it applied (a freed
  slot is reused only once every serving process has seen it freed), and its counters; and a histogram of
  its routing overheads (log buckets :data:`BUCKET_RATIO` apart), merged for ``/metrics``.
* **Session affinity** (:data:`AFFINITY_SLOTS` entries, :mod:`~miles_disagg.router.affinity`): per routing
  key's hash, the slot of the worker that served it last, written by whichever process routed it (one
  aligned 8-byte value holding the hash's tag and the slot, so a reader sees a whole entry or an older one).

Pure data layout and I/O on the mapping; no event loop, no HTTP.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import mmap
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from miles_disagg.router.registry import MAX_OLDER_VERSIONS_BYTES, older_versions_json

CAPACITY = 4096
"""Workers a multi-process router can hold at once (a registration beyond it is refused)."""
URL_BYTES, RUN_BYTES, OLDER_BYTES = 256, 128, MAX_OLDER_VERSIONS_BYTES
STRING_BYTES = URL_BYTES + RUN_BYTES + OLDER_BYTES  # per slot
RING = 8192
SLOT_INTS = 8  # present, admin state, health flags, version (-1: unknown), failure count, url length, run id length,
# older versions' JSON length
HEADER_INTS = 8  # magic, capacity, processes, sequence number, -
STAT_FIELDS = 5  # in flight, answered, busy seconds, busy since (0: idle), last answer (time.monotonic, 0: none)
PROC_FIELDS = 24  # pid, serving, applied sequence number, -, then COUNTERS
HIST_BUCKETS = 1024
AFFINITY_SLOTS = 1 << 16
BUCKET_RATIO = 1.02
BUCKET_FLOOR_S = 1e-6
MAGIC = 0x6D64_7274  # "mdrt"
COUNTERS = ("requests", "version_not_ready", "no_worker_available", "worker_failed", "connect_retries",
            "connect_timeouts_of_live_workers", "stale_view", "client_disconnected", "session_affinity_hits",
            "session_moves")
ADMIN_CODES = ("ready", "paused", "activating")
EVER_HEALTHY, UNHEALTHY = 1, 2
IN_FLIGHT, ANSWERED, BUSY_S, BUSY_SINCE, LAST_ANSWER = range(STAT_FIELDS)
PID, SERVING, APPLIED_SEQ = range(3)
_COUNTERS_AT = 4
_LOG_RATIO = math.log(BUCKET_RATIO)


@dataclass(frozen=True)
class SlotRecord:
    """One slot as the leader last wrote it (``present`` False: free)."""

    slot: int
    present: bool
    url: str = ""
    admin_state: str = "ready"
    ever_healthy: bool = False
    unhealthy: bool = False
    weight_version: int | None = None
    run_id: str | None = None
    failures: int = 0
    older_versions: tuple[tuple[int, str], ...] = ()  # (version, lora_path), ascending


@dataclass(frozen=True)
class LoadTotals:
    """One worker's load over every process: in flight and answered summed; busy seconds of the busiest
    process (a lower bound of the time any process had a request on it); the latest answer."""

    in_flight: int
    answered: int
    busy_s: float
    last_answer_at: float | None


def _layout(processes: int) -> dict[str, int]:
    """Byte offsets of each region (every one 8-byte aligned)."""
    at = {"ring": HEADER_INTS * 8}
    at["slots"] = at["ring"] + RING * 8
    at["strings"] = at["slots"] + CAPACITY * SLOT_INTS * 8
    at["procs"] = at["strings"] + CAPACITY * STRING_BYTES
    at["stats"] = at["procs"] + processes * PROC_FIELDS * 8
    at["hist"] = at["stats"] + processes * CAPACITY * STAT_FIELDS * 8
    at["affinity"] = at["hist"] + processes * HIST_BUCKETS * 8
    at["end"] = at["affinity"] + AFFINITY_SLOTS * 8
    return at


class SharedTable:
    """The mapping of one router's table file; :meth:`create` (the leader) or :meth:`attach` (the others)."""

    def __init__(self, path: Path, fd: int, processes: int):
        self.path, self.processes = Path(path), processes
        self._fd = fd
        self._at = _layout(processes)
        self._map = mmap.mmap(fd, self._at["end"])
        view = memoryview(self._map)
        self._ints = view[:self._at["strings"]].cast("q")
        self._bytes = view[self._at["strings"]:self._at["procs"]]
        self._floats = view[self._at["procs"]:self._at["affinity"]].cast("d")
        self._affinity = view[self._at["affinity"]:].cast("q")
        self._procs_at, self._stats_at = 0, (self._at["stats"] - self._at["procs"]) // 8
        self._hist_at = (self._at["hist"] - self._at["procs"]) // 8
        self._slots_at = self._at["slots"] // 8

    @classmethod
    def create(cls, path: Path, processes: int) -> "SharedTable":
        """A new zeroed table for ``processes`` processes (the leader is process 0)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, _layout(processes)["end"])
        table = cls(path, fd, processes)  # ftruncate zeroed it
        table._ints[0], table._ints[1], table._ints[2] = MAGIC, CAPACITY, processes
        return table

    @classmethod
    def attach(cls, path: Path) -> "SharedTable":
        """The table another process created; ``ValueError`` when ``path`` is not one."""
        fd = os.open(path, os.O_RDWR)
        header = os.pread(fd, HEADER_INTS * 8, 0)
        magic, capacity, processes = (int.from_bytes(header[i:i + 8], "little", signed=True) for i in (0, 8, 16))
        if magic != MAGIC or capacity != CAPACITY:
            os.close(fd)
            raise ValueError(f"{path} is not a router table of this version")
        return cls(path, fd, processes)

    def close(self) -> None:
        for view in (self._ints, self._bytes, self._floats, self._affinity):
            view.release()
        self._map.close()
        os.close(self._fd)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The table's lock (writers of slots and readers of changes take it; held for microseconds)."""
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ slots (the leader writes)

    @property
    def seq(self) -> int:
        """The table's sequence number: how many slot writes there have been."""
        return self._ints[3]

    def write(self, record: SlotRecord) -> None:
        """Write one slot and announce it (ring, then sequence number), under the lock."""
        url, run = record.url.encode(), (record.run_id or "").encode()
        older = older_versions_json(dict(record.older_versions)) if record.older_versions else b""
        if len(url) > URL_BYTES or len(run) > RUN_BYTES or len(older) > OLDER_BYTES:
            raise ValueError(f"a worker URL of at most {URL_BYTES} bytes, a run id of at most {RUN_BYTES} bytes and "
                             f"older versions of at most {OLDER_BYTES} bytes fit the table, got {len(url)}, "
                             f"{len(run)} and {len(older)}")
        base = self._slots_at + record.slot * SLOT_INTS
        flags = (EVER_HEALTHY if record.ever_healthy else 0) | (UNHEALTHY if record.unhealthy else 0)
        version = -1 if record.weight_version is None else record.weight_version
        text_at = record.slot * STRING_BYTES
        with self.locked():
            ints = self._ints
            for offset, value in enumerate((int(record.present), ADMIN_CODES.index(record.admin_state), flags,
                                            version, record.failures, len(url), len(run), len(older))):
                ints[base + offset] = value
            self._bytes[text_at:text_at + len(url)] = url
            self._bytes[text_at + URL_BYTES:text_at + URL_BYTES + len(run)] = run
            older_at = text_at + URL_BYTES + RUN_BYTES
            self._bytes[older_at:older_at + len(older)] = older
            seq = ints[3]
            ints[HEADER_INTS + seq % RING] = record.slot
            ints[3] = seq + 1

    def changes_since(self, seen: int) -> tuple[int, list[SlotRecord]]:
        """The sequence number now and every slot written after ``seen`` (each once, as it is now; all
        slots when more than :data:`RING` writes happened since)."""
        with self.locked():
            seq = self._ints[3]
            if seq - seen > RING:
                slots: set[int] | range = range(CAPACITY)
            else:
                slots = {self._ints[HEADER_INTS + s % RING] for s in range(seen, seq)}
            return seq, [self._read(slot) for slot in sorted(slots)]

    def _read(self, slot: int) -> SlotRecord:
        base = self._slots_at + slot * SLOT_INTS
        present, admin, flags, version, failures, url_len, run_len, older_len = self._ints[base:base + 8].tolist()
        if not present:
            return SlotRecord(slot, False)
        text_at = slot * STRING_BYTES
        url = bytes(self._bytes[text_at:text_at + url_len]).decode()
        run = bytes(self._bytes[text_at + URL_BYTES:text_at + URL_BYTES + run_len]).decode()
        older_at = text_at + URL_BYTES + RUN_BYTES
        older = json.loads(bytes(self._bytes[older_at:older_at + older_len])) if older_len else {}
        return SlotRecord(slot, True, url, ADMIN_CODES[admin], bool(flags & EVER_HEALTHY), bool(flags & UNHEALTHY),
                          None if version < 0 else version, run or None, failures,
                          tuple((int(v), path) for v, path in older.items()))

    # ------------------------------------------------------------------ load columns (each process its own)

    def stat_index(self, process: int, slot: int) -> int:
        """Where process ``process``'s load of ``slot`` starts in :attr:`floats`."""
        return self._stats_at + (process * CAPACITY + slot) * STAT_FIELDS

    @property
    def floats(self) -> memoryview:
        """The float view of the process rows, load columns and histograms (writers index it directly)."""
        return self._floats

    def clear_load(self, process: int, slot: int) -> None:
        at = self.stat_index(process, slot)
        self._floats[at:at + STAT_FIELDS] = memoryview(bytearray(STAT_FIELDS * 8)).cast("d")

    def load_totals(self, slot: int, now: float) -> LoadTotals:
        """``slot``'s load summed over the processes (busy time counted up to ``now``, time.monotonic)."""
        in_flight = answered = 0
        busy = last = 0.0
        for process in range(self.processes):
            at = self.stat_index(process, slot)
            flying, served, busy_s, since, answer = self._floats[at:at + STAT_FIELDS].tolist()
            in_flight, answered = in_flight + int(flying), answered + int(served)
            busy = max(busy, busy_s + (now - since if since else 0.0))
            last = max(last, answer)
        return LoadTotals(in_flight, answered, busy, last or None)

    # ------------------------------------------------------------------ session affinity (any process writes)

    def affinity_slot(self, key_hash: int) -> int | None:
        """The worker slot last recorded for a routing key's 64-bit hash, or None."""
        entry = self._affinity[key_hash % AFFINITY_SLOTS]
        if entry <= 0 or entry >> 16 != key_hash >> 17:
            return None
        return (entry & 0xFFFF) - 1

    def set_affinity_slot(self, key_hash: int, slot: int) -> None:
        self._affinity[key_hash % AFFINITY_SLOTS] = (key_hash >> 17) << 16 | (slot + 1)

    # ------------------------------------------------------------------ process rows and histograms

    def proc_index(self, process: int, field: int) -> int:
        return self._procs_at + process * PROC_FIELDS + field

    def set_proc(self, process: int, field: int, value: float) -> None:
        self._floats[self.proc_index(process, field)] = value

    def proc(self, process: int, field: int) -> float:
        return self._floats[self.proc_index(process, field)]

    def counter_index(self, process: int, name: str) -> int:
        return self.proc_index(process, _COUNTERS_AT + COUNTERS.index(name))

    def counters(self, process: int) -> dict[str, int]:
        at = self.proc_index(process, _COUNTERS_AT)
        return dict(zip(COUNTERS, (int(v) for v in self._floats[at:at + len(COUNTERS)].tolist())))

    def clear_process(self, process: int) -> None:
        """Forget a process that exited: its row, its load columns and its histogram."""
        row = self.proc_index(process, 0)
        self._floats[row:row + PROC_FIELDS] = memoryview(bytearray(PROC_FIELDS * 8)).cast("d")
        start = self.stat_index(process, 0)
        self._floats[start:start + CAPACITY * STAT_FIELDS] = memoryview(bytearray(CAPACITY * STAT_FIELDS * 8)).cast("d")
        hist = self.hist_index(process)
        self._floats[hist:hist + HIST_BUCKETS] = memoryview(bytearray(HIST_BUCKETS * 8)).cast("d")

    def hist_index(self, process: int) -> int:
        return self._hist_at + process * HIST_BUCKETS

    def merged_histogram(self) -> list[float]:
        total = [0.0] * HIST_BUCKETS
        for process in range(self.processes):
            at = self.hist_index(process)
            total = [a + b for a, b in zip(total, self._floats[at:at + HIST_BUCKETS].tolist())]
        return total


def bucket_of(seconds: float) -> int:
    """The histogram bucket of a duration (bucket ``b`` holds [floor * ratio**b, floor * ratio**(b+1)))."""
    if seconds <= BUCKET_FLOOR_S:
        return 0
    return min(HIST_BUCKETS - 1, int(math.log(seconds / BUCKET_FLOOR_S) / _LOG_RATIO))


def histogram_percentiles_ms(counts: list[float]) -> dict[str, float | int | None]:
    """p50/p99/max in milliseconds from merged bucket counts (each bucket read as its upper bound: within
    :data:`BUCKET_RATIO` of the true value), in the shape of the single process's ``routing_overhead_ms``."""
    total = int(sum(counts))
    if not total:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    upper = lambda b: round(BUCKET_FLOOR_S * BUCKET_RATIO ** (b + 1) * 1e3, 3)  # noqa: E731

    def at(q: float) -> float:
        rank, seen = min(total - 1, int(q * total)), 0.0
        for bucket, count in enumerate(counts):
            seen += count
            if seen > rank:
                return upper(bucket)
        return upper(HIST_BUCKETS - 1)

    last = max(b for b, count in enumerate(counts) if count)
    return {"count": total, "p50": at(0.5), "p99": at(0.99), "max": upper(last)}
