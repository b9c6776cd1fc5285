"""The service's measurements (the reference page's "What to measure"). Pure: no I/O.

* :class:`ConvergenceTracker` - version convergence: seconds from a version's completed
  publication until a fraction of the live capacity (replicas heartbeating, not draining)
  advertises it or a newer version of the same run (a replica that coalesced past it
  counts). Publication times come from the store (index time), seen by replicas; all
  clocks are wall clocks (comparable on one machine; across hosts they need NTP).
* :class:`RequestStats` - per request: outcome counts, request version lag (newest
  published minus the served start version; served start minus the requested minimum),
  mixed-version samples, constraint violations (must stay 0) and the gateway's own
  overhead (time in the gateway minus time waiting for workers).

Per-replica prepare and pause times come with each replica's activation records
(:class:`~miles_disagg.service.protocol.Activation`); :func:`summary` condenses them.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import Iterable, Sequence

from miles_disagg.service.protocol import StoreHead
from miles_disagg.types import VersionConstraint, same_run

DEFAULT_FRACTIONS = (0.5, 1.0)
MAX_TRACKED_VERSIONS = 256
MAX_OVERHEAD_SAMPLES = 50_000


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summary(values: Iterable[float]) -> dict[str, float | int | None]:
    values = list(values)
    if not values:
        return {"count": 0, "last": None, "mean": None, "max": None}
    return {"count": len(values), "last": values[-1], "mean": sum(values) / len(values), "max": max(values)}


class ConvergenceTracker:
    """Per published version: when each capacity fraction first advertised it."""

    def __init__(self, fractions: Sequence[float] = DEFAULT_FRACTIONS):
        if not fractions or any(not 0 < f <= 1 for f in fractions):
            raise ValueError(f"fractions must be in (0, 1], got {fractions!r}")
        self.fractions = tuple(sorted(fractions))
        self._published: dict[tuple[str, int], float | None] = {}
        self._converged: dict[tuple[str, int], dict[float, float | None]] = {}

    def observe_head(self, head: StoreHead | None) -> None:
        """A replica saw ``head`` as the store's newest version (version 0 is not a publication)."""
        if head is None or head.version == 0:
            return
        key = (head.run_id, head.version)
        if key not in self._published or self._published[key] is None:
            self._published[key] = head.published_unix
            self._converged.setdefault(key, {})
        while len(self._published) > MAX_TRACKED_VERSIONS:
            oldest = next(iter(self._published))
            del self._published[oldest], self._converged[oldest]

    def observe_fleet(self, advertised: Sequence[tuple[str, int] | None], now_unix: float) -> None:
        """``advertised``: per live replica, the (run, version) it serves and advertises (None if not ready)."""
        if not advertised:
            return
        for key, reached in self._converged.items():
            if len(reached) == len(self.fractions):
                continue
            run_id, version = key
            have = sum(1 for a in advertised if a is not None and same_run(a[0], run_id) and a[1] >= version)
            for fraction in self.fractions:
                if fraction not in reached and have >= fraction * len(advertised) - 1e-9:
                    published = self._published[key]
                    reached[fraction] = None if published is None else max(0.0, now_unix - published)

    def converged_s(self, version: int, fraction: float = 1.0, run_id: str = "") -> float | None:
        for (run, v), reached in self._converged.items():
            if v == version and same_run(run, run_id) and reached.get(fraction) is not None:
                return reached[fraction]
        return None

    def to_json(self) -> dict:
        versions = {}
        for (run_id, version), reached in self._converged.items():
            versions[str(version)] = {
                "run_id": run_id, "published_unix": self._published[(run_id, version)],
                "converged_s": {_key(f): reached.get(f) for f in self.fractions}}
        return {"fractions": list(self.fractions), "versions": versions}


def _key(fraction: float) -> str:
    return f"{fraction:g}"


class RequestStats:
    """Outcome counts, version lag and gateway overhead over every proxied request."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lag_behind_newest: Counter[int] = Counter()
        self.lag_over_min: Counter[int] = Counter()
        self.overhead_s: deque[float] = deque(maxlen=MAX_OVERHEAD_SAMPLES)

    def observe(self, status: int, constraint: VersionConstraint, served: Sequence[tuple[int | None, int | None]],
                newest: int | None, total_s: float, upstream_s: float) -> None:
        self.counts[_outcome(status)] += 1
        if not 200 <= status < 300:
            return
        self.overhead_s.append(max(0.0, total_s - upstream_s))
        for start, end in served:
            self.counts["samples"] += 1
            if start is None or end is None:
                self.counts["samples_unattributed"] += 1
                continue
            if start != end:
                self.counts["samples_mixed_version"] += 1
            if not constraint.allows_version(start) or (constraint.min_version is not None and end < constraint.min_version):
                self.counts["samples_violating_constraint"] += 1
            if newest is not None:
                self.lag_behind_newest[max(0, newest - start)] += 1
            if constraint.min_version is not None:
                self.lag_over_min[start - constraint.min_version] += 1

    def to_json(self) -> dict:
        overhead_ms = [s * 1e3 for s in self.overhead_s]
        return {
            "counts": dict(self.counts),
            "version_lag_behind_newest": _histogram(self.lag_behind_newest),
            "version_lag_over_min": _histogram(self.lag_over_min),
            "gateway_overhead_ms": {"count": len(overhead_ms), "p50": percentile(overhead_ms, 50),
                                    "p99": percentile(overhead_ms, 99)},
        }


def _outcome(status: int) -> str:
    if 200 <= status < 300:
        return "served"
    return {409: "version_not_ready", 503: "no_replica_available", 502: "replica_failed",
            499: "client_disconnected"}.get(status, f"status_{status}")


def _histogram(counter: Counter[int]) -> dict:
    total = sum(counter.values())
    mean = sum(k * n for k, n in counter.items()) / total if total else None
    return {"count": total, "mean": mean, "max": max(counter) if counter else None,
            "histogram": {str(k): counter[k] for k in sorted(counter)}}
