"""Session affinity: every turn of a session goes to the engine that served its previous turn.

A request names its session with the routing-key header (miles' ``X-SMG-Routing-Key``, which
SGLang's model gateway reads the same way). The router keeps, per key, the worker that served it
last; the next request with that key goes there while that worker is ``ready``, was not tried
already by this request and satisfies the request's version constraint. Otherwise (it left, died,
is paused or activating, or holds another version) the request is routed as any other (fewest
outstanding, :mod:`~miles_disagg.router.policy`) and, when the key had a worker before, the move is
counted (``/metrics`` ``session_moves``). A request without the header is routed as before, at the
cost of one header lookup.

Where the keys live: :class:`LocalAffinity` for a router of one process (a bounded LRU map), and for
a router of several processes a table in their shared memory (:mod:`~miles_disagg.router.shared_table`,
written by whichever process routed the key last), so a session's turns stay on one engine
whichever process the kernel hands each connection to. Keys are hashed to 64 bits
(:func:`key_hash`, the same in every process); the shared table is direct-mapped, so two live keys
that collide share one entry (the later one wins; the other's next turn is routed afresh and
counted as a move).

The prefix cache of the engine is what affinity buys; the router also tells the engine which cache
namespace a keyed ``/generate`` belongs to (:func:`version_extra_key`: SGLang's ``extra_key``, miles'
``weight-version:N``) unless the body names one, so an SGLang engine never reuses KV across policy
versions for it (the built-in engine also drops its cache at every weight swap).
"""

from __future__ import annotations

import collections
import hashlib
from collections import Counter
from typing import AbstractSet, Any, Hashable, Mapping

from miles_disagg.router.policy import worker_satisfies
from miles_disagg.router.registry import Worker, WorkerState
from miles_disagg.types import InvalidInput, VersionConstraint

ROUTING_KEY_HEADER = "x-smg-routing-key"
MAX_KEY_CHARS = 256
LOCAL_CAPACITY = 1 << 17
"""Keys a one-process router remembers (least recently routed forgotten first)."""
EXTRA_KEY_PREFIX = "weight-version:"
GONE = object()
"""What a session's last worker is once it left the registry (the key had one: its next turn is a move)."""


def routing_key(headers: Mapping[str, str]) -> str | None:
    """The request's routing key (``headers``: lower-case names), or None. ``InvalidInput`` for an
    empty, over-long or non-printable one."""
    raw = headers.get(ROUTING_KEY_HEADER)
    if raw is None:
        return None
    key = raw.strip()
    if not key or len(key) > MAX_KEY_CHARS or not key.isprintable():
        raise InvalidInput(f"header {ROUTING_KEY_HEADER} must be 1-{MAX_KEY_CHARS} printable characters, "
                           f"got {raw[:40]!r}")
    return key


def key_hash(key: str) -> int:
    """A 64-bit hash of ``key``, equal in every process (Python's ``hash`` of a str is not)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def version_extra_key(version: int | None) -> str:
    """miles' cache namespace of a policy version (an unknown version is the base's, 0)."""
    return f"{EXTRA_KEY_PREFIX}{0 if version is None else version}"


class LocalAffinity:
    """Key -> the worker that served it last, for one process; bounded, least recently used dropped."""

    def __init__(self, capacity: int = LOCAL_CAPACITY):
        self.capacity = capacity
        self._last: collections.OrderedDict[str, Hashable] = collections.OrderedDict()

    def get(self, key: str) -> Hashable | None:
        worker = self._last.get(key)
        if worker is not None:
            self._last.move_to_end(key)
        return worker

    def put(self, key: str, worker: Hashable) -> None:
        self._last[key] = worker
        self._last.move_to_end(key)
        if len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)


def choose_for_session(policy: Any, registry: Any, peers: Any, key: str, constraint: VersionConstraint,
                       skip: AbstractSet[Worker], counters: Counter) -> Worker:
    """The worker for one turn of session ``key`` (see the module docstring); ``peers`` keeps the keys
    (:class:`~miles_disagg.router.peers.SoleRouter` and its shared forms). Raises as
    ``policy.choose_in`` does when the session must move and nothing can take it."""
    previous = peers.session_worker(key)
    if (previous is not None and previous is not GONE and previous.state is WorkerState.READY and previous not in skip
            and worker_satisfies(previous, constraint)):
        counters["session_affinity_hits"] += 1
        return previous
    worker = policy.choose_in(registry, constraint, skip=skip)
    if previous is not None and worker is not previous:
        counters["session_moves"] += 1
    peers.remember_session(key, worker)
    return worker
