"""A progress line while the driver waits on something slow (a trainer's setup, engines starting, a
batch of groups while engines are down, an activation): no wait longer than a few seconds is silent."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from miles_disagg.tracking import status

EVERY_S = 10.0


@contextlib.contextmanager
def still(doing: str, every_s: float = EVERY_S, detail: Callable[[], str | None] | None = None) -> Iterator[None]:
    """``still <doing> (Ns)`` every ``every_s`` until the block ends (a daemon thread; it prints only),
    followed by ``: <detail()>`` where ``detail`` says more (what is awaited now; an error or None: nothing)."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            line = f"still {doing} ({time.monotonic() - start:.0f}s)"
            more = _detail(detail)
            status(f"{line}: {more}" if more else line)

    thread = threading.Thread(target=beat, name="progress-line", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)


def _detail(detail: Callable[[], str | None] | None) -> str | None:
    if detail is None:
        return None
    try:
        return detail()
    except Exception:  # noqa: BLE001 - the line is a courtesy: a failed read leaves it short
        return None
