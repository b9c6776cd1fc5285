"""Worker registry of the router: each worker's state, weight version and load. Pure, no I/O.

A worker's displayed ``state`` combines two independent axes:

* the *admin state* (``ready`` | ``paused`` | ``activating``), set by whoever updates the
  worker's weights (``POST /set_worker_state``); it starts as ``ready``;
* its *health*, learned from probes and from proxied requests.

``state`` is ``unhealthy`` while the health axis says so, ``starting`` until the first
successful probe, and the admin state otherwise. Only ``ready`` workers receive new
requests. Because the axes are separate, a worker that recovers from ``unhealthy``
returns to its admin state: a worker paused for an update stays out of routing until the
updater marks it ready again, so a half-updated engine is never routed to by accident.

Versions are ints; ``None`` means unknown (e.g. SGLang's ``"default"``). A worker serving LoRA adapter
versions may keep older ones resident beside its newest (``weight_version``): ``older_versions`` maps
each to the ``lora_path`` that runs a request on it (the engine's ``resident_weight_versions``, read with
its version by every probe); exact-version requests for them may go there. The version a
probe reads is authoritative (it may go down, e.g. an engine restarted from the base),
except that a probe whose read predates a newer version seen since it started does not
move the version back. A version seen in a proxied response only moves it forward.

Not thread-safe: the router mutates it from one event loop. ``listener`` (optional) is called with a
worker (and whether it was just removed) after every change of what routing reads of it (membership, admin
state, health, version, run): a multi-process router publishes those to its other processes
(:mod:`miles_disagg.router.peers`).
"""

from __future__ import annotations

import enum
import json
import time
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from miles_disagg.types import InvalidInput


MAX_OLDER_VERSIONS = 16
"""Older resident versions a worker may list (a longer list in a probe's answer fails the probe)."""
MAX_OLDER_VERSIONS_BYTES = 512
"""The most bytes their JSON (:func:`older_versions_json`) may take: a router's processes share it."""
NO_OLDER_VERSIONS: Mapping[int, str] = types.MappingProxyType({})


class UnknownWorker(InvalidInput):
    """The URL names no registered worker."""

    def __init__(self, url: str):
        self.url = url
        super().__init__(f"no worker {url!r} is registered")


class WorkerState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    PAUSED = "paused"
    ACTIVATING = "activating"
    UNHEALTHY = "unhealthy"


ADMIN_STATES = frozenset({WorkerState.READY, WorkerState.PAUSED, WorkerState.ACTIVATING})


def parse_version(value: Any) -> int | None:
    """A weight version as an int: a non-negative int or a decimal string; ``None`` otherwise."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def normalize_url(url: Any) -> str:
    """``http://host:port`` without a trailing slash; ``host:port`` gets ``http://``.

    Raises ``InvalidInput`` for anything that is not an http(s) URL with a host.
    """
    if not isinstance(url, str) or not url.strip():
        raise InvalidInput(f"worker url must be a non-empty string, got {url!r}")
    given = url
    url = url.strip()
    if "://" not in url:
        url = f"http://{url}"
    scheme, _, rest = url.partition("://")
    rest = rest.rstrip("/")
    if scheme not in ("http", "https") or not rest or "/" in rest or not rest.isprintable() or " " in rest:
        raise InvalidInput(f"worker url must look like http://host:port, got {given!r}")
    return f"{scheme}://{rest}"


@dataclass(frozen=True)
class ProbeTicket:
    """What a probe saw when it started; lets a slow probe's result yield to newer news."""

    version_seq: int
    failure_seq: int
    answered_seq: int = 0


@dataclass(eq=False)
class Worker:
    """One engine behind the router. Mutated only through :class:`WorkerRegistry`."""

    url: str
    admin_state: WorkerState = WorkerState.READY
    weight_version: int | None = None
    run_id: str | None = None  # the run whose version it serves, when an authenticated replica said so
    outstanding: int = 0
    num_served: int = 0
    consecutive_failures: int = 0
    ever_healthy: bool = False
    unhealthy: bool = False
    last_error: str | None = None
    version_seq: int = 0
    failure_seq: int = 0
    busy_s: float = 0.0  # wall time with at least one request outstanding, up to busy_since
    busy_since: float | None = None
    answered_seq: int = 0  # proxied requests it answered (evidence it is alive, whatever a probe saw meanwhile)
    last_answer_at: float | None = None  # time.monotonic() of the last one
    probe_due: bool = False  # an answer contradicted its known version: its next probe is not skipped
    older_versions: Mapping[int, str] = field(default_factory=dict)  # older resident version -> its lora_path
    # (module docstring); set whole, never changed in place

    def busy_seconds(self, now: float | None = None) -> float:
        """Cumulative time this worker had a request in flight (the engine-busy metric)."""
        if self.busy_since is None:
            return self.busy_s
        return self.busy_s + ((time.monotonic() if now is None else now) - self.busy_since)

    @property
    def state(self) -> WorkerState:
        if self.unhealthy:
            return WorkerState.UNHEALTHY
        if not self.ever_healthy:
            return WorkerState.STARTING
        return self.admin_state

    @property
    def healthy(self) -> bool:
        """The last probe succeeded and nothing failed since."""
        return self.ever_healthy and not self.unhealthy and self.consecutive_failures == 0

    def to_json(self) -> dict[str, Any]:
        older = {str(v): path for v, path in self.older_versions.items()}
        return {"url": self.url, "weight_version": self.weight_version, "run_id": self.run_id, "state": self.state.value,
                **({"older_versions": older} if older else {}),
                "outstanding": self.outstanding, "healthy": self.healthy, "last_error": self.last_error,
                "num_served": self.num_served, "busy_s": round(self.busy_seconds(), 6)}


class WorkerRegistry:
    """Registered workers in registration order (the round-robin order of the policy)."""

    def __init__(self, *, failure_threshold: int = 2, listener: Callable[[Worker, bool], None] | None = None):
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.listener = listener
        self._workers: dict[str, Worker] = {}
        # Every worker filed by its outstanding count (each bucket in the order its workers entered it), so the
        # policy finds the least loaded without a pass over the pool: at 256 workers that pass was a tenth of
        # the router's CPU per request (py-spy, ``miles-disagg bench scale``).
        self._by_load: dict[int, dict[Worker, None]] = {0: {}}

    # ------------------------------------------------------------------ membership

    def add(self, url: str) -> Worker:
        """Register ``url`` (state ``starting``); re-adding a registered URL returns it unchanged."""
        url = normalize_url(url)
        worker = self._workers.get(url)
        if worker is None:
            worker = self._workers[url] = Worker(url=url)
            self._file(worker)
            self._changed(worker)
        return worker

    def remove(self, url: str) -> Worker:
        """Unregister; requests already sent to it finish normally. ``UnknownWorker`` if absent."""
        worker = self.get(url)
        del self._workers[worker.url]
        self._unfile(worker)
        self._changed(worker, removed=True)
        return worker

    def contains(self, worker: Worker) -> bool:
        """Whether ``worker`` (this object, not only its URL) is registered."""
        return self._workers.get(worker.url) is worker

    def _changed(self, worker: Worker, removed: bool = False) -> None:
        if self.listener is not None:
            self.listener(worker, removed)

    def get(self, url: str) -> Worker:
        worker = self._workers.get(normalize_url(url))
        if worker is None:
            raise UnknownWorker(url)
        return worker

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def by_load(self):
        """Every worker, least outstanding first; equal loads in the order they reached that load
        (a worker moved to the back with :meth:`to_back`). Do not change the registry while iterating."""
        for load in sorted(self._by_load):
            yield from self._by_load[load]

    def to_back(self, worker: Worker) -> None:
        """Move ``worker`` behind the others of its load (round robin among equals)."""
        bucket = self._by_load[worker.outstanding]
        del bucket[worker]
        bucket[worker] = None

    def _file(self, worker: Worker) -> None:
        self._by_load.setdefault(worker.outstanding, {})[worker] = None

    def _unfile(self, worker: Worker) -> None:
        bucket = self._by_load[worker.outstanding]
        del bucket[worker]
        if not bucket and worker.outstanding:
            del self._by_load[worker.outstanding]

    # ------------------------------------------------------------------ admin state and load

    def set_admin_state(self, url: str, state: WorkerState | str, weight_version: int | None = None,
                        run_id: str | None = None) -> Worker:
        """Mark a worker ``ready``/``paused``/``activating`` (and optionally its new version and run).

        A version given here is authoritative: callers pass only what the worker itself just
        answered to an authenticated probe.
        """
        try:
            state = WorkerState(state)
        except ValueError:
            state = None
        if state not in ADMIN_STATES:
            raise InvalidInput(f"state must be one of {sorted(s.value for s in ADMIN_STATES)}, got {state!r}")
        worker = self.get(url)
        worker.admin_state = state
        if weight_version is not None:
            self._set_version(worker, weight_version)
        if run_id is not None:
            worker.run_id = run_id or None
        self._changed(worker)
        return worker

    def assign(self, worker: Worker, *, admin_state: WorkerState | str, weight_version: int | None, run_id: str | None,
               ever_healthy: bool, unhealthy: bool, older_versions: Mapping[int, str] = NO_OLDER_VERSIONS) -> None:
        """Take what routing reads of ``worker`` from an authoritative copy (the view a router process
        keeps of the leader's registry, :mod:`miles_disagg.router.peers`); load and history stay this one's."""
        worker.admin_state = WorkerState(admin_state)
        self._set_version(worker, weight_version)
        worker.older_versions = older_versions or NO_OLDER_VERSIONS
        worker.run_id = run_id
        worker.ever_healthy, worker.unhealthy = ever_healthy, unhealthy

    def acquire(self, worker: Worker) -> None:
        """A request was dispatched to ``worker``."""
        if worker.outstanding == 0:
            worker.busy_since = time.monotonic()
        self._move(worker, 1)

    def release(self, worker: Worker, *, served: bool) -> None:
        """A dispatched request ended (``served``: the worker answered it without failing)."""
        self._move(worker, -1)
        if worker.outstanding == 0 and worker.busy_since is not None:
            worker.busy_s += time.monotonic() - worker.busy_since
            worker.busy_since = None
        if served:
            worker.num_served += 1
            worker.answered_seq += 1
            worker.last_answer_at = time.monotonic()

    def answered_within(self, worker: Worker, seconds: float) -> bool:
        """Whether ``worker`` answered a proxied request in the last ``seconds``."""
        return worker.last_answer_at is not None and time.monotonic() - worker.last_answer_at <= seconds

    def _move(self, worker: Worker, by: int) -> None:
        """Change ``worker.outstanding`` by ``by``, keeping its filing (a removed worker is not refiled)."""
        registered = self._workers.get(worker.url) is worker
        if registered:
            self._unfile(worker)
        worker.outstanding += by
        if registered:
            self._file(worker)

    # ------------------------------------------------------------------ versions

    def observe_version(self, worker: Worker, version: int | None) -> None:
        """A proxied response reported ``version``: move the worker's version forward only.

        Responses finish out of order, so an older version in a late response is stale news; it only makes
        the worker's next probe due (:attr:`Worker.probe_due`: an engine restarted from an older version
        answers so until a probe reads its version).
        """
        if version is None or version in worker.older_versions:  # an answer of an older resident adapter
            return
        if worker.weight_version is None or version > worker.weight_version:
            self._set_version(worker, version)
            self._changed(worker)
        elif version < worker.weight_version:
            worker.probe_due = True

    def _set_version(self, worker: Worker, version: int | None) -> None:
        if version != worker.weight_version:
            worker.weight_version = version
            worker.version_seq += 1

    # ------------------------------------------------------------------ health

    def ticket(self, worker: Worker) -> ProbeTicket:
        """Take before probing ``worker``; hand back to :meth:`record_probe_ok`."""
        return ProbeTicket(worker.version_seq, worker.failure_seq, worker.answered_seq)

    def record_probe_ok(self, worker: Worker, version: int | None, ticket: ProbeTicket,
                        older_versions: Mapping[int, str] = NO_OLDER_VERSIONS) -> None:
        """A probe found the worker healthy at ``version``, with ``older_versions`` resident beside it.

        Ignored when a failure was recorded after the probe started (the next probe decides).
        The version read (and its older versions) is applied unless a newer one was learned while the probe ran.
        """
        if worker.failure_seq != ticket.failure_seq:
            return
        newer_seen = worker.version_seq != ticket.version_seq and (
            version is None or (worker.weight_version is not None and version < worker.weight_version))
        if not newer_seen:
            self._set_version(worker, version)
            worker.older_versions = older_versions or NO_OLDER_VERSIONS
        worker.ever_healthy = True
        worker.unhealthy = False
        worker.consecutive_failures = 0
        worker.last_error = None
        worker.probe_due = False
        self._changed(worker)

    def record_probe_failure(self, worker: Worker, error: str, *, definite: bool,
                             ticket: ProbeTicket | None = None) -> None:
        """A probe failed. ``definite`` (refused connection, error status) takes a ready worker
        out at once; otherwise (a timeout) only ``failure_threshold`` failures in a row do.

        A timeout is not counted when the worker answered a proxied request while the probe ran
        (``ticket``: taken when it started): the worker is alive, and the probe was slow on the
        router's side (a router with thousands of requests queued on its event loop timed out its own
        probes and took every healthy worker out). A worker that never passed a probe stays
        ``starting`` (with ``last_error``).
        """
        if not definite and ticket is not None and worker.answered_seq != ticket.answered_seq:
            return
        worker.consecutive_failures += 1
        worker.last_error = error
        worker.failure_seq += 1
        if worker.ever_healthy and (definite or worker.consecutive_failures >= self.failure_threshold):
            worker.unhealthy = True
        self._changed(worker)

    def mark_failed(self, worker: Worker, error: str) -> None:
        """A proxied request failed on the worker: out of routing at once, until a later probe passes."""
        worker.consecutive_failures += 1
        worker.last_error = error
        worker.failure_seq += 1
        worker.unhealthy = True
        self._changed(worker)


def parse_older_versions(listed: Any, newest: int | None) -> dict[int, str]:
    """An engine's ``resident_weight_versions`` (``{"version": lora_path}``, its newest among them) as the
    versions older than ``newest`` with their ``lora_path``s; ``ValueError`` naming what is malformed
    (absent or ``null``: none)."""
    if listed is None:
        return {}
    if not isinstance(listed, dict) or len(listed) > MAX_OLDER_VERSIONS + 1:
        raise ValueError(f"resident_weight_versions must be an object of at most {MAX_OLDER_VERSIONS + 1} "
                         "version -> lora_path entries")
    older = {}
    for key, path in listed.items():
        version = parse_version(key)
        if version is None or not isinstance(path, str) or not path or not path.isprintable():
            raise ValueError(f"resident_weight_versions: {key!r} -> {path!r} is not a version and a lora_path")
        if newest is None or version > newest:
            raise ValueError(f"resident_weight_versions lists {version}, newer than weight_version {newest}")
        if version < newest:
            older[version] = path
    if len(older_versions_json(older)) > MAX_OLDER_VERSIONS_BYTES:
        raise ValueError(f"resident_weight_versions takes more than {MAX_OLDER_VERSIONS_BYTES} bytes")
    return older


def older_versions_json(older: Mapping[int, str]) -> bytes:
    """``older`` as compact JSON bytes (what a multi-process router's shared table holds)."""
    return json.dumps({str(v): path for v, path in sorted(older.items())}, separators=(",", ":")).encode()
