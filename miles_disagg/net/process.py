"""Child HTTP processes (engine, agent, router, sglang-router): start, wait until healthy, stop.

The child's stdout/stderr go to ``log_path`` so a failed start can show why; a start that
fails (the process exits, or never answers its health path in time) stops the process and
raises the caller's error type with the log tail.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from miles_disagg.types import MilesDisaggError

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


def listen_socket(host: str, port: int, backlog: int = 2048, *, reuse_port: bool = False) -> socket.socket:
    """Bind and listen now, so a taken port fails fast (``ConfigError`` naming --host/--port);
    port 0 picks a free one. The socket is inheritable (a server may hand it to uvicorn). ``reuse_port``:
    ``SO_REUSEPORT``, so the processes of one server (all of them setting it) listen on one port."""
    from miles_disagg.types import ConfigError

    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc}", flags=("--host", "--port")) from exc
    sock.listen(backlog)
    sock.set_inheritable(True)
    return sock


# A port for a server of ours when none is given. The kernel's own pick (bind to port 0) lies in its
# ephemeral range, from which every outgoing connection on the machine takes its source port: between
# the pick and the server's own bind any connect() may take it, and the server then exits with
# "Address already in use" (seen under the test suite's load, hundreds of connections a second). Below
# that range only an explicit bind takes a port. Ray's workers bind 10002-19999 by default.
PICK_FLOOR = 20000
PICK_TRIES = 64
LINUX_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_pick = random.SystemRandom()  # not the random module's state, which forked processes share


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on ``host`` is bound to now, outside the kernel's ephemeral range when the
    range leaves room (else the kernel's pick)."""
    low, high = ephemeral_port_range()
    for candidates in (range(PICK_FLOOR, low), range(high + 1, 65536)):
        if len(candidates) < 1000:
            continue
        for _ in range(PICK_TRIES):
            port = _pick.choice(candidates)
            if _can_bind(host, port):
                return port
    return _kernel_pick(host)


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux's file; else from 32768 up,
    which covers Linux's default and the IANA range other systems use)."""
    try:
        low, high = (int(part) for part in LINUX_EPHEMERAL_RANGE.read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 65535


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def _kernel_pick(host: str) -> int:
    with socket.socket(_family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class NotHealthy(MilesDisaggError):
    """:func:`wait_healthy` gave up: the process exited, or time ran out (``reason`` says which)."""

    def __init__(self, reason: str, exit_code: int | None = None):
        self.reason, self.exit_code = reason, exit_code
        super().__init__(reason)


def wait_healthy(url: str, *, health_path: str = "/health", timeout_s: float, poll_s: float = 0.1,
                 probe_timeout_s: float = 2.0, proc: subprocess.Popen | None = None) -> None:
    """Until ``GET url+health_path`` answers 200: the one "is it up yet" loop of the project.

    Raises :class:`NotHealthy` when ``proc`` (if given) exits first or ``timeout_s`` runs out;
    its reason names the last answer seen. Never kills anything: that is the caller's call.
    """
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    # one client for the whole wait: a new one per poll (httpx.get) loads the CA bundle each time,
    # about 40 ms of CPU per poll, seconds per engine start at 10 polls a second
    with httpx.Client(timeout=probe_timeout_s, trust_env=False) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise NotHealthy(f"exited with {proc.returncode}", proc.returncode)
            try:
                response = client.get(f"{url}{health_path}")
                if response.status_code == 200:
                    return
                last = f"{health_path} answered {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if time.monotonic() >= deadline:
                raise NotHealthy(f"not healthy after {timeout_s:g}s ({last})")
            time.sleep(poll_s)


def start_http_process(cmd: Sequence[str], *, url: str, log_path: Path, health_path: str, what: str,
                       error: type[Exception], startup_timeout_s: float, poll_s: float = 0.1,
                       probe_timeout_s: float = 2.0, env: dict[str, str] | None = None,
                       launched: type[LaunchedProcess] = LaunchedProcess):
    """Start ``cmd`` and return ``launched(url, proc, log_path)`` once ``GET url+health_path`` is 200.

    A start that fails (the process exits, or is not healthy in ``startup_timeout_s``) stops the
    process and raises ``error`` with the log tail.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ) if env is None else env, preexec_fn=die_with_parent)
    child = launched(url=url, proc=proc, log_path=log_path)
    try:
        wait_healthy(url, health_path=health_path, timeout_s=startup_timeout_s, poll_s=poll_s,
                     probe_timeout_s=probe_timeout_s, proc=proc)
    except NotHealthy as exc:
        child.stop()
        raise error(f"{what} at {url} {exc.reason}:\n{child.logs()[-LOG_TAIL_CHARS:]}") from None
    return child
