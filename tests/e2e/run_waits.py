"""Waiting on a whole run a test started: a condition, while the run is still alive; a condition alone."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_while_running(done, run: subprocess.Popen, log: Path, timeout_s: float, what: str,
                       poll_s: float = 0.2) -> None:
    """Until ``done()``; fails naming ``what`` if the run ends first (with its log's tail) or
    ``timeout_s`` (already scaled for the machine's load) passes."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert run.poll() is None, f"the run ended (exit {run.returncode}) before {what}: {log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s:.0f}s"
        time.sleep(poll_s)


def wait_for(condition, timeout_s: float, what: str, poll_s: float = 1.0) -> None:
    """Until ``condition()``; fails naming ``what`` after ``timeout_s`` (already scaled for the
    machine's load)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll_s)
