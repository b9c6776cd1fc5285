"""Child HTTP processes (engine, agent, router, sglang-router): start, wait until healthy, stop.

The child's stdout/stderr go to ``log_path`` so a failed start can show why; a start that
fails (the process exits, or never answers its health path in time) stops the process and
raises the caller's error type with the log tail.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

LOG_TAIL_CHARS = 4000


@dataclass
class LaunchedProcess:
    """A running child process that serves HTTP at ``url``."""

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


def die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM it when the process that started it dies, so
    a crashed or killed owner (a Ray actor, a driver) never leaves engines or routers behind."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the owner's own shutdown path still stops the child


def listen_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Bind and listen now, so a taken port fails fast (``ConfigError`` naming --host/--port);
    port 0 picks a free one. The socket is inheritable (a server may hand it to uvicorn)."""
    from miles_disagg.types import ConfigError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}", flags=("--host", "--port")) from exc
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_http_process(cmd: Sequence[str], *, url: str, log_path: Path, health_path: str, what: str,
                       error: type[Exception], startup_timeout_s: float, poll_s: float = 0.1,
                       env: dict[str, str] | None = None, launched: type[LaunchedProcess] = LaunchedProcess):
    """Start ``cmd`` and return ``launched(url, proc, log_path)`` once ``GET url+health_path`` is 200."""
    import httpx

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ) if env is None else env, preexec_fn=die_with_parent)
    child = launched(url=url, proc=proc, log_path=log_path)
    deadline = time.monotonic() + startup_timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise error(f"{what} exited with {proc.returncode}:\n{child.logs()[-LOG_TAIL_CHARS:]}")
        try:
            if httpx.get(f"{url}{health_path}", timeout=2.0, trust_env=False).status_code == 200:
                return child
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    child.stop()
    raise error(f"{what} not healthy after {startup_timeout_s}s:\n{child.logs()[-LOG_TAIL_CHARS:]}")
