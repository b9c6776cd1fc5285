"""The gateway's table of replicas, fed by heartbeats. Pure: no I/O; times are passed in.

Each replica is known by its ``replica_id``; its engine URL is the router worker it
maps to. :meth:`Fleet.apply` takes a heartbeat and says what the router must do:
register the engine, drop a previous engine URL (a restarted replica launched a new
engine), and which worker state and version to set. Stale heartbeats (same incarnation,
``seq`` not newer) are ignored.

Liveness: a replica whose last heartbeat is older than ``timeout_s`` is *lost*: taken
out of routing (its engine may still answer probes, but nobody vouches for its version
anymore) and out of the capacity convergence is measured against; a heartbeat brings it
back. After ``forget_s`` without one it is removed, with its worker.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from miles_disagg.service.protocol import ReplicaState, ReplicaStatus, StoreHead, router_state

MAX_TRANSITIONS = 64


@dataclass
class ReplicaEntry:
    status: ReplicaStatus
    last_seen: float  # monotonic seconds
    lost: bool = False
    transitions: deque = field(default_factory=lambda: deque(maxlen=MAX_TRANSITIONS))  # (unix, state, version)

    def advertised(self) -> tuple[str, int] | None:
        """(run, version) this replica serves and advertises: only when ready and not lost."""
        s = self.status
        if self.lost or s.state is not ReplicaState.READY or s.weight_version is None:
            return None
        return s.run_id, s.weight_version

    def to_json(self, now: float) -> dict:
        s = self.status
        return {**s.to_json(), "lost": self.lost, "heartbeat_age_s": round(max(0.0, now - self.last_seen), 3),
                "transitions": [list(t) for t in self.transitions]}


@dataclass(frozen=True)
class Applied:
    """What the router must do for one accepted heartbeat."""

    engine_url: str | None  # register (if new) and set the state of this worker
    dropped_url: str | None  # remove this worker (the replica's previous engine)
    worker_state: str  # ready | activating | paused
    weight_version: int | None


@dataclass(frozen=True)
class Expired:
    replica_id: str
    engine_url: str | None
    forgotten: bool  # removed from the table (else only marked lost)


class Fleet:
    """Replica entries by id (insertion order). Not thread-safe: one event loop owns it."""

    def __init__(self, *, timeout_s: float, forget_s: float):
        if not 0 < timeout_s <= forget_s:
            raise ValueError(f"need 0 < timeout_s <= forget_s, got {timeout_s}, {forget_s}")
        self.timeout_s, self.forget_s = timeout_s, forget_s
        self._replicas: dict[str, ReplicaEntry] = {}

    def entries(self) -> list[ReplicaEntry]:
        return list(self._replicas.values())

    def get(self, replica_id: str) -> ReplicaEntry | None:
        return self._replicas.get(replica_id)

    def apply(self, status: ReplicaStatus, now: float, now_unix: float) -> Applied | None:
        """Record a heartbeat; ``None`` when it is stale (an older one of the same incarnation)."""
        entry = self._replicas.get(status.replica_id)
        if entry is not None and entry.status.incarnation == status.incarnation and status.seq <= entry.status.seq:
            return None
        previous_url = entry.status.engine_url if entry is not None else None
        if entry is None:
            entry = self._replicas[status.replica_id] = ReplicaEntry(status, now)
        before = None if not entry.transitions else entry.transitions[-1][1:]
        entry.status, entry.last_seen, entry.lost = status, now, False
        if (status.state.value, status.weight_version) != before:
            entry.transitions.append((round(now_unix, 3), status.state.value, status.weight_version))
        dropped = previous_url if previous_url and previous_url != status.engine_url else None
        version = status.weight_version if status.state is ReplicaState.READY else None
        return Applied(status.engine_url, dropped, router_state(status.state), version)

    def remove(self, replica_id: str) -> ReplicaEntry | None:
        return self._replicas.pop(replica_id, None)

    def expire(self, now: float) -> list[Expired]:
        """Mark replicas silent for ``timeout_s`` lost; forget those silent for ``forget_s``."""
        expired = []
        for replica_id, entry in list(self._replicas.items()):
            age = now - entry.last_seen
            if age >= self.forget_s:
                del self._replicas[replica_id]
                expired.append(Expired(replica_id, entry.status.engine_url, True))
            elif age >= self.timeout_s and not entry.lost:
                entry.lost = True
                expired.append(Expired(replica_id, entry.status.engine_url, False))
        return expired

    def capacity(self) -> list[tuple[str, int] | None]:
        """One item per live replica (not lost, not draining): what it advertises, or None."""
        return [e.advertised() for e in self._replicas.values()
                if not e.lost and e.status.state is not ReplicaState.DRAINING]

    def newest_head(self) -> StoreHead | None:
        heads = [e.status.store_head for e in self._replicas.values() if e.status.store_head is not None]
        return max(heads, key=lambda h: h.version, default=None)

    def control_urls(self) -> list[str]:
        return [e.status.control_url for e in self._replicas.values() if e.status.control_url and not e.lost]
