"""Start the router as a subprocess and wait until it answers ``/health``.

The child (``python -m miles_disagg.router``) writes stdout/stderr to ``log_path``, so a
failed start can show why. Workers given here are probed once before the router starts
listening, so they are ``ready`` (if alive) when :func:`launch_router` returns.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from miles_disagg.net.process import LaunchedProcess, free_port, start_http_process
from miles_disagg.router.client import RouterClient
from miles_disagg.types import ReplaceReplica

DEFAULT_STARTUP_TIMEOUT_S = 60.0


class RouterStartFailed(ReplaceReplica):
    """The router process exited or never answered ``/health``; it has been stopped."""


class LaunchedRouter(LaunchedProcess):
    """A running router process: its URL, process handle and log file."""

    def client(self, timeout_s: float = 30.0) -> RouterClient:
        """A new :class:`RouterClient` for this router (close it when done)."""
        return RouterClient(self.url, timeout_s=timeout_s)


def launch_router(
    *, log_path: Path, workers: Sequence[str] = (), port: int | None = None, host: str = "127.0.0.1",
    health_check_interval_s: float = 1.0, retry_after_s: float = 1.0, extra_args: Sequence[str] = (),
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> LaunchedRouter:
    """Start ``python -m miles_disagg.router`` on ``host:port`` (a free port by default).

    Raises ``RouterStartFailed`` (with the log tail) if the process exits or does not
    answer ``/health`` within ``startup_timeout_s``; the process is stopped in that case.
    """
    port = port or free_port(host)
    cmd = router_command(host=host, port=port, workers=workers, health_check_interval_s=health_check_interval_s,
                         retry_after_s=retry_after_s, extra_args=extra_args)
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/health",
                              what="router", error=RouterStartFailed, startup_timeout_s=startup_timeout_s,
                              poll_s=0.05, launched=LaunchedRouter)


def router_command(*, host: str, port: int | str, workers: Sequence[str] = (), health_check_interval_s: float = 1.0,
                   retry_after_s: float = 1.0, extra_args: Sequence[str] = ()) -> list[str]:
    """The argv :func:`launch_router` runs (``--dry-run`` prints it with ``{port}`` unfilled)."""
    cmd = [sys.executable, "-m", "miles_disagg.router", "--host", host, "--port", str(port),
           "--health-check-interval", str(health_check_interval_s), "--retry-after-s", str(retry_after_s)]
    if workers:
        cmd += ["--worker", *workers]
    return cmd + list(extra_args)
