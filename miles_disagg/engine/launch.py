"""Start the built-in engine as a subprocess and wait until it answers ``/health``.

Used by the benchmark, the tests and anything else that needs a local engine process.
The child's stdout/stderr go to ``log_path`` (so a failed start can show why).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from miles_disagg.types import EngineUnrecoverable

DEFAULT_STARTUP_TIMEOUT_S = 180.0


@dataclass
class LaunchedEngine:
    """A running engine process: its URL, process handle and log file."""

    url: str
    proc: subprocess.Popen
    log_path: Path

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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch_engine(
    model_dir: Path, *, log_path: Path, port: int | None = None, host: str = "127.0.0.1",
    extra_args: Sequence[str] = (), startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> LaunchedEngine:
    """Start ``python -m miles_disagg.engine`` on ``host:port`` (a free port by default).

    Raises ``EngineUnrecoverable`` (with the log tail) if the process exits or does not
    become healthy within ``startup_timeout_s``; the process is stopped in that case.
    """
    import httpx

    port = port or free_port(host)
    cmd = [sys.executable, "-m", "miles_disagg.engine", "--model-path", str(model_dir),
           "--host", host, "--port", str(port), *extra_args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    engine = LaunchedEngine(url=f"http://{host}:{port}", proc=proc, log_path=log_path)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineUnrecoverable(f"engine exited with {proc.returncode}:\n{engine.logs()[-4000:]}")
        try:
            if httpx.get(f"{engine.url}/health", timeout=2.0).status_code == 200:
                return engine
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    engine.stop()
    raise EngineUnrecoverable(f"engine not healthy after {startup_timeout_s}s:\n{engine.logs()[-4000:]}")
