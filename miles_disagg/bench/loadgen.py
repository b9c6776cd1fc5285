"""Concurrent request load: ``concurrency`` threads, each with its own HTTP client, calling
``one(http, worker, n)`` until ``stop()``; every returned record is kept in order of arrival.

Used by the benchmarks and by the tests that put engines, routers and services under load.
"""

from __future__ import annotations

import threading
from typing import Any, Callable


class RequestThreads:
    def __init__(self, concurrency: int, one: Callable[[Any, int, int], Any], *, base_url: str | None = None,
                 timeout_s: float = 60.0, once: bool = False):
        """``one`` sends one request and returns its record (or None to keep nothing); with
        ``once`` each thread sends a single request."""
        self.timeout_s = timeout_s
        self.records: list = []
        self._one, self._base_url, self._once = one, base_url, once
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]
        for thread in self._threads:
            thread.start()

    def _run(self, worker: int) -> None:
        import httpx

        kwargs = {"base_url": self._base_url} if self._base_url else {}
        with httpx.Client(timeout=self.timeout_s, trust_env=False, **kwargs) as http:
            n = 0
            while self._sends(n):
                record = self._one(http, worker, n)
                if record is not None:
                    with self._lock:
                        self.records.append(record)
                n += 1

    def _sends(self, n: int) -> bool:
        """Whether a thread sends its request ``n``: with ``once`` the first and no other (a
        ``stop()`` before a slow thread's first request does not cancel it), else until ``stop()``."""
        return n == 0 if self._once else not self._stop.is_set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def count(self) -> int:
        with self._lock:
            return len(self.records)

    def stop(self, join_timeout_s: float | None = None) -> list:
        """Stop sending and wait for the requests in flight; ``AssertionError`` if one hangs."""
        self._stop.set()
        for thread in self._threads:
            thread.join(join_timeout_s if join_timeout_s is not None else self.timeout_s + 10)
            assert not thread.is_alive(), "a load thread still waits for an answer (a request hangs past its timeout)"
        return list(self.records)
