"""How late the router's own event loop runs: a timeout seen while the loop lagged is the router's, not the worker's.

With thousands of requests queued on a starved router (``miles-disagg bench scale``, 2,048 in flight at
256 engines on a loaded 2-core machine), probes and connects timed out because the router itself did
not get to read their answers: it took every healthy worker out and answered 503 to everything. The
router therefore samples its loop's lag (a wake-up every :data:`PERIOD_S`, cheap), and a timeout that
happened while the lag reached a share of the timeout does not count against the worker (its probes
decide again once the router keeps up). Refusals and error statuses count as before.
"""

from __future__ import annotations

import asyncio
import collections

PERIOD_S = 0.1
KEEP_S = 120.0


class LoopLag:
    """Lag samples of the loop :meth:`run_forever` runs on (loop-time stamps)."""

    def __init__(self, period_s: float = PERIOD_S, keep_s: float = KEEP_S):
        self.period_s, self.keep_s = period_s, keep_s
        self._samples: collections.deque[tuple[float, float]] = collections.deque()  # (sampled at, lag)
        self._waiting_since: float | None = None

    async def run_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._waiting_since = loop.time()
            await asyncio.sleep(self.period_s)
            now = loop.time()
            self._samples.append((now, max(0.0, now - self._waiting_since - self.period_s)))
            while self._samples and self._samples[0][0] < now - self.keep_s:
                self._samples.popleft()

    def worst_since(self, since: float) -> float:
        """The longest lag (seconds) sampled at or after loop time ``since``, the wake-up now overdue included."""
        now = asyncio.get_running_loop().time()
        overdue = 0.0 if self._waiting_since is None else max(0.0, now - self._waiting_since - self.period_s)
        return max([lag for at, lag in self._samples if at >= since] + [overdue])

    def excuses(self, since: float, timeout_s: float) -> bool:
        """Whether a timeout of ``timeout_s`` for something started at loop time ``since`` may be the
        router's own doing: its loop lagged at least half the timeout meanwhile."""
        return self.worst_since(since) >= timeout_s / 2
