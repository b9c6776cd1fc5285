"""A progress line while the driver waits on something slow (a trainer's setup, engines starting):
no wait longer than a few seconds is silent."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

from miles_disagg.tracking import status

EVERY_S = 10.0


@contextlib.contextmanager
def still(doing: str, every_s: float = EVERY_S) -> Iterator[None]:
    """``still <doing> (Ns)`` every ``every_s`` until the block ends (a daemon thread; it prints only)."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(every_s):
            status(f"still {doing} ({time.monotonic() - start:.0f}s)")

    thread = threading.Thread(target=beat, name="progress-line", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
