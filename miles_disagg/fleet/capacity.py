"""How few rollout engines a run may go on with, and for how long (``--min-rollout-engines``).

A lost rollout node costs capacity, not the run (:mod:`miles_disagg.fleet.replace`): its
engines leave the router and the run goes on with the rest. :class:`CapacityPolicy` (pure) is
fed the number of serving engines by the engine manager's monitor and says when the run must
end: fewer than ``--min-rollout-engines`` served for longer than
``--min-rollout-engines-timeout`` seconds (a node that comes back, or a new one, can bring
capacity back within that time). The driver asks through :mod:`miles_disagg.loop.capacity`.
"""

from __future__ import annotations

import time
from typing import Callable


NOT_ANSWERING = "down (its process exited or it failed its health checks)"
"""Why an engine is out when Ray has not (yet) said its node or actor is gone."""


class CapacityPolicy:
    """Tracks since when fewer than ``min_engines`` engines serve."""

    def __init__(self, min_engines: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.min_engines, self.timeout_s, self._clock = min_engines, timeout_s, clock
        self.live: int | None = None
        self.total: int | None = None
        self.below_since: float | None = None

    def observe(self, live: int, total: int) -> None:
        """``live`` of ``total`` engines serve now."""
        self.live, self.total = live, total
        if live >= self.min_engines:
            self.below_since = None
        elif self.below_since is None:
            self.below_since = self._clock()

    def below_for(self) -> float:
        """Seconds the run has had too few engines (0 while it has enough)."""
        return 0.0 if self.below_since is None else self._clock() - self.below_since

    def verdict(self, why: str = "") -> str | None:
        """The line that ends the run, once too few engines served for longer than the timeout."""
        if self.below_since is None or self.below_for() <= self.timeout_s:
            return None
        line = (f"only {self.live} of {self.total} rollout engine(s) served for {self.below_for():.0f}s, fewer than "
                f"--min-rollout-engines {self.min_engines} for longer than --min-rollout-engines-timeout "
                f"{self.timeout_s:g}s")
        return f"{line}; {why}" if why else line

    def report(self, events: list[dict], down: set[int], removed: int = 0) -> dict:
        """:meth:`state` plus ``verdict``, naming why the engines still out left (the engine
        manager's ``node_lost`` / ``actor_lost`` events; ``removed``: how many left by ``engines remove``)."""
        gone = {e["engine"]: e["why"] for e in events if e["event"] in ("node_lost", "actor_lost")}
        why = "; ".join(f"engine {i}: {gone.get(i, NOT_ANSWERING)}" for i in sorted(down))
        if removed and not down:
            why = f"{removed} engine(s) left by engines remove and no engine has joined since (engines add)"
        return {**self.state(), "verdict": self.verdict(why)}

    def state(self) -> dict:
        return {"live": self.live, "total": self.total, "min_engines": self.min_engines,
                "below_for_s": round(self.below_for(), 3)}
