"""The async data buffer between the rollout producer and the trainer, with staleness rules.

Staleness (DESIGN.md section 6), with ``K = --max-weight-staleness``:

* admission: a rollout request asks for ``min_version = current - K`` (clipped at 0),
  see :meth:`GroupBuffer.admission_min_version`;
* consumption: a group whose oldest sample started on a version older than
  ``current - K`` is dropped and counted, never returned. A sample's version comes from
  the engine's response (``Sample.weight_version_start``), never from a trainer counter.
  A group exactly ``K`` versions behind is kept; ``K + 1`` behind is dropped.
  ``K = None`` keeps everything.
* discarded versions (:meth:`GroupBuffer.discard_versions`): versions published by a trainer
  that failed and was restarted from an older save are not in the restored trainer's lineage,
  so their distance from it is not the difference of version numbers; a group any of whose
  engine calls ran on one is dropped (and counted) whatever ``K`` is.

Concurrency: one :class:`threading.Condition` guards all state; any number of producer
threads may :meth:`~GroupBuffer.put` while consumers :meth:`~GroupBuffer.take`. Groups are
returned in arrival order (first put, first taken) among the admissible ones.
Consumers must pass a non-decreasing ``current_version``: a dropped group is gone, which
is only right because versions never go back.

Removal contract: every group leaves the buffer exactly once, taken or dropped. ``on_dropped(n)``
(if given) is called, with the lock held, each time ``n`` stale groups are dropped - also while a
consumer is still waiting - so a producer that bounds its window by groups "in flight or
buffered" can reuse those slots at once instead of waiting for the next successful take
(otherwise a window made entirely of groups that turned stale together would never refill).
The callback must not call back into the buffer.

Selection: by default a take returns the oldest admissible groups; ``select(groups, n)`` (the
``--buffer-filter-path`` hook, see ``filters.buffer_selector``) may choose other ``n`` of them.

Timeout contract: ``take`` is all or nothing. When ``timeout`` passes before ``n_groups``
admissible groups are buffered it raises :class:`BufferTimeout` and leaves every
admissible group in the buffer (stale groups found meanwhile stay dropped and are
reported by the next successful take). :meth:`~GroupBuffer.close` wakes every waiter
with :class:`BufferClosed`; later ``put`` and ``take`` calls raise it too.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from miles_disagg.samples import Group
from miles_disagg.types import InvalidInput, MilesDisaggError, Retryable


class BufferClosed(MilesDisaggError):
    """The buffer was closed (the run is stopping); stop producing and consuming."""


class BufferTimeout(Retryable):
    """Fewer admissible groups than asked arrived in time; nothing was taken."""

    def __init__(self, requested: int, available: int, timeout_s: float):
        self.requested, self.available, self.timeout_s = requested, available, timeout_s
        super().__init__(f"asked for {requested} groups, {available} admissible after {timeout_s:.3g}s")


@dataclass(frozen=True)
class TakeResult:
    """Groups handed to the trainer, with the staleness of their samples at hand-over.

    ``num_dropped`` counts the stale groups dropped since the previous successful take.
    Per sample, staleness is ``current_version - weight_version_start``.
    """

    groups: list[Group]
    current_version: int
    num_dropped: int
    staleness_mean: float
    staleness_max: int
    mixed_version_ratio: float

    def metrics(self) -> dict[str, float]:
        """The rollout staleness metrics under their logged names."""
        return {
            "rollout/staleness_mean": self.staleness_mean,
            "rollout/staleness_max": float(self.staleness_max),
            "rollout/stale_groups_dropped": float(self.num_dropped),
            "rollout/mixed_version_ratio": self.mixed_version_ratio,
        }


def summarize(groups: list[Group], current_version: int, num_dropped: int) -> TakeResult:
    """Staleness statistics over every sample of ``groups`` (zeros for no samples)."""
    samples = [sample for group in groups for sample in group.samples]
    staleness = [current_version - s.weight_version_start for s in samples]
    count = len(samples)
    return TakeResult(
        groups=list(groups),
        current_version=current_version,
        num_dropped=num_dropped,
        staleness_mean=sum(staleness) / count if count else 0.0,
        staleness_max=max(staleness) if count else 0,
        mixed_version_ratio=sum(s.mixed_version for s in samples) / count if count else 0.0,
    )


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class GroupBuffer:
    """Completed groups waiting for the trainer; drops groups beyond the staleness bound."""

    def __init__(self, max_weight_staleness: int | None, *, on_dropped: Callable[[int], None] | None = None,
                 select: Callable[[list[Group], int], list[Group]] | None = None):
        if max_weight_staleness is not None and not _is_count(max_weight_staleness):
            raise InvalidInput(f"max_weight_staleness must be None or an int >= 0, got {max_weight_staleness!r}")
        self.max_weight_staleness = max_weight_staleness
        self._on_dropped = on_dropped
        self._select = select
        self._cond = threading.Condition()
        self._groups: deque[Group] = deque()
        self._closed = False
        self._last_version: int | None = None
        self._discarded: list[tuple[int, int]] = []  # (first, last) version ranges
        self._dropped_unreported = 0
        self._num_waiting = 0
        self.num_put = 0
        self.num_dropped = 0
        self.num_taken = 0

    # ------------------------------------------------------------------ admission

    def admission_min_version(self, current_version: int) -> int | None:
        """The ``min_version`` a rollout request must ask for: ``current - K`` clipped at 0; ``None`` if no bound."""
        if self.max_weight_staleness is None:
            return None
        return max(0, current_version - self.max_weight_staleness)

    def is_admissible(self, group: Group, current_version: int | None) -> bool:
        """A group is kept iff its oldest start version is at least ``current - K`` (``current``
        None: no bound) and none of its samples ran on a discarded version."""
        if self._discarded and any(_touches(s, self._discarded) for s in group.samples):
            return False
        minimum = None if current_version is None else self.admission_min_version(current_version)
        return minimum is None or group.oldest_version >= minimum

    def discard_versions(self, first: int, last: int) -> int:
        """Versions ``first..last`` left the trainer's lineage (a restarted trainer republished
        its older saved state as a newer version): buffered groups that ran on one are dropped
        now, and those still arriving are dropped on arrival. Returns how many were dropped now."""
        if not (_is_count(first) and _is_count(last) and first <= last):
            raise InvalidInput(f"discard_versions needs 0 <= first <= last, got {first!r}..{last!r}")
        with self._cond:
            self._discarded.append((first, last))
            return self._drop_stale(self._last_version)

    # ------------------------------------------------------------------ producer / consumer

    def put(self, group: Group) -> None:
        """Add a completed group and wake waiting consumers; ``BufferClosed`` after close. A group
        already stale against the newest version a consumer used is dropped (and counted) at once."""
        if not group.samples:
            raise InvalidInput(f"group of prompt {group.prompt_index} has no samples")
        with self._cond:
            if self._closed:
                raise BufferClosed("put on a closed buffer")
            self._groups.append(group)
            self.num_put += 1
            if self._last_version is not None or self._discarded:  # stale on arrival: drop it now
                self._drop_stale(self._last_version)
            self._cond.notify_all()

    def take(self, n_groups: int, current_version: int, timeout: float | None = None) -> TakeResult:
        """Block until ``n_groups`` admissible groups are buffered; return the first ``n_groups``.

        Stale groups are dropped as they are found, also while waiting. Raises
        ``BufferTimeout`` (nothing taken) when ``timeout`` seconds pass first,
        ``BufferClosed`` when the buffer is or becomes closed, ``InvalidInput`` for
        ``n_groups < 1`` or a ``current_version`` below one already used.
        """
        if not _is_count(n_groups) or n_groups < 1:
            raise InvalidInput(f"take needs n_groups >= 1, got {n_groups!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._check_version(current_version)
            while True:
                if self._closed:
                    raise BufferClosed("the buffer was closed while waiting for groups")
                self._drop_stale(current_version)
                if len(self._groups) >= n_groups:
                    return self._pop(n_groups, current_version)
                self._wait_until(deadline, n_groups, timeout)

    def drop_stale(self, current_version: int) -> int:
        """Drop the groups that are stale against ``current_version`` now (the trainer moved on);
        return how many. The same version rule as ``take`` applies."""
        with self._cond:
            self._check_version(current_version)
            return self._drop_stale(current_version)

    def close(self) -> None:
        """Refuse further puts and takes and wake every waiter (they raise ``BufferClosed``)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ------------------------------------------------------------------ inspection

    def __len__(self) -> int:
        """Groups buffered now (some may turn out stale at the next take)."""
        with self._cond:
            return len(self._groups)

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    @property
    def num_waiting(self) -> int:
        """Consumers blocked in ``take`` right now."""
        with self._cond:
            return self._num_waiting

    def counters(self) -> dict[str, int]:
        """Lifetime counts: groups put, dropped as stale, taken; and buffered now."""
        with self._cond:
            return {"num_put": self.num_put, "num_dropped": self.num_dropped,
                    "num_taken": self.num_taken, "num_buffered": len(self._groups)}

    # ------------------------------------------------------------------ internals (lock held)

    def _check_version(self, current_version: int) -> None:
        if not _is_count(current_version):
            raise InvalidInput(f"current_version must be an int >= 0, got {current_version!r}")
        if self._last_version is not None and current_version < self._last_version:
            raise InvalidInput(f"current_version went back from {self._last_version} to {current_version}; "
                               "stale groups were already dropped against the newer version")
        self._last_version = current_version

    def _drop_stale(self, current_version: int | None) -> int:
        kept = deque(g for g in self._groups if self.is_admissible(g, current_version))
        dropped = len(self._groups) - len(kept)
        if dropped:
            self._groups = kept
            self.num_dropped += dropped
            self._dropped_unreported += dropped
            if self._on_dropped is not None:
                self._on_dropped(dropped)
        return dropped

    def _pop(self, n_groups: int, current_version: int) -> TakeResult:
        if self._select is None:
            groups = [self._groups.popleft() for _ in range(n_groups)]
        else:
            groups = self._select(list(self._groups), n_groups)
            chosen = {id(g) for g in groups}
            self._groups = deque(g for g in self._groups if id(g) not in chosen)
        self.num_taken += n_groups
        dropped, self._dropped_unreported = self._dropped_unreported, 0
        return summarize(groups, current_version, dropped)

    def _wait_until(self, deadline: float | None, n_groups: int, timeout: float | None) -> None:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise BufferTimeout(n_groups, len(self._groups), timeout)
        self._num_waiting += 1
        try:
            self._cond.wait(remaining)
        finally:
            self._num_waiting -= 1


def _touches(sample, ranges: list[tuple[int, int]]) -> bool:
    """Whether one of the sample's engine calls ran on a version in one of ``ranges``."""
    calls = sample.call_versions or [[sample.weight_version_start, sample.weight_version_end]]
    return any(start <= last and end >= first for start, end in calls for first, last in ranges)
