"""Start the built-in engine as a subprocess and wait until it answers ``/health``.

Used by the benchmark, the tests and anything else that needs a local engine process.
The child's stdout/stderr go to ``log_path`` (so a failed start can show why).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from miles_disagg.process import LaunchedProcess, free_port, start_http_process
from miles_disagg.types import EngineUnrecoverable

__all__ = ["LaunchedEngine", "free_port", "launch_engine"]

DEFAULT_STARTUP_TIMEOUT_S = 180.0


class LaunchedEngine(LaunchedProcess):
    """A running engine process: its URL, process handle and log file."""


def launch_engine(
    model_dir: Path, *, log_path: Path, port: int | None = None, host: str = "127.0.0.1",
    extra_args: Sequence[str] = (), startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> LaunchedEngine:
    """Start ``python -m miles_disagg.engine`` on ``host:port`` (a free port by default).

    Raises ``EngineUnrecoverable`` (with the log tail) if the process exits or does not
    become healthy within ``startup_timeout_s``; the process is stopped in that case.
    """
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "miles_disagg.engine", "--model-path", str(model_dir),
           "--host", host, "--port", str(port), *extra_args]
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/health",
                              what="engine", error=EngineUnrecoverable, startup_timeout_s=startup_timeout_s,
                              poll_s=0.2, launched=LaunchedEngine)
