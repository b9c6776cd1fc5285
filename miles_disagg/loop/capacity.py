"""The driver's side of ``--min-rollout-engines``: :class:`CapacityWatch`.

Registered with :func:`miles_disagg.remote.add_watch` once the engines run; it asks the engine
manager (whose monitor feeds :class:`~miles_disagg.fleet.capacity.CapacityPolicy`) at most
every ``interval_s`` and raises :class:`~miles_disagg.types.RolloutCapacityLost` with the
manager's line once too few engines served for too long: the launcher prints it and exits 1.
"""

from __future__ import annotations

import time
from typing import Callable

from miles_disagg.types import RolloutCapacityLost

CAPACITY_CHECK_INTERVAL_S = 2.0


class CapacityWatch:
    """Raises :class:`RolloutCapacityLost` once the engine manager's policy says the run must end
    (asks at most every ``interval_s``; after that, raises every time)."""

    def __init__(self, ask: Callable[[], dict], interval_s: float = CAPACITY_CHECK_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        """``ask``: the engine manager's ``capacity()`` (``{"verdict": str | None, ...}``)."""
        self._ask, self.interval_s, self._clock = ask, interval_s, clock
        self._checked = -interval_s
        self._lost: RolloutCapacityLost | None = None

    def __call__(self) -> None:
        if self._lost is None and self._clock() - self._checked >= self.interval_s:
            self._checked = self._clock()
            try:
                verdict = self._ask().get("verdict")
            except Exception:  # the manager is busy or going away: its own errors reach the run elsewhere
                verdict = None
            if verdict:
                self._lost = RolloutCapacityLost(verdict)
        if self._lost is not None:
            raise self._lost
