"""Start the router as a subprocess and wait until it answers ``/health``.

The child (``python -m miles_disagg.router``) writes stdout/stderr to ``log_path``, so a
failed start can show why. Workers given here are probed once before the router starts
listening, so they are ``ready`` (if alive) when :func:`launch_router` returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from miles_disagg.router.client import RouterClient
from miles_disagg.types import ReplaceReplica

DEFAULT_STARTUP_TIMEOUT_S = 60.0


class RouterStartFailed(ReplaceReplica):
    """The router process exited or never answered ``/health``; it has been stopped."""


@dataclass
class LaunchedRouter:
    """A running router process: its URL, process handle and log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path

    def client(self, timeout_s: float = 30.0) -> RouterClient:
        """A new :class:`RouterClient` for this router (close it when done)."""
        return RouterClient(self.url, timeout_s=timeout_s)

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``; idempotent."""
        if self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=timeout_s)


def launch_router(
    *, log_path: Path, workers: Sequence[str] = (), port: int | None = None, host: str = "127.0.0.1",
    health_check_interval_s: float = 1.0, retry_after_s: float = 1.0, extra_args: Sequence[str] = (),
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> LaunchedRouter:
    """Start ``python -m miles_disagg.router`` on ``host:port`` (a free port by default).

    Raises ``RouterStartFailed`` (with the log tail) if the process exits or does not
    answer ``/health`` within ``startup_timeout_s``; the process is stopped in that case.
    """
    from miles_disagg.engine.launch import free_port

    port = port or free_port(host)
    cmd = [sys.executable, "-m", "miles_disagg.router", "--host", host, "--port", str(port),
           "--health-check-interval", str(health_check_interval_s), "--retry-after-s", str(retry_after_s)]
    if workers:
        cmd += ["--worker", *workers]
    cmd += list(extra_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    router = LaunchedRouter(url=f"http://{host}:{port}", proc=proc, log_path=log_path)
    with router.client(timeout_s=2.0) as client:
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RouterStartFailed(f"router exited with {proc.returncode}:\n{router.logs()[-4000:]}")
            if client.health():
                return router
            time.sleep(0.05)
    router.stop()
    raise RouterStartFailed(f"router not healthy after {startup_timeout_s}s:\n{router.logs()[-4000:]}")
