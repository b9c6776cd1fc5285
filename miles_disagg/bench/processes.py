"""The child processes of ``bench scale`` and what it reads of them.

* :func:`start_announcing`: start a child and wait for the line announcing it is up;
* :class:`SimFleetProcess`: ``miles-disagg sim-engines`` (:mod:`miles_disagg.bench.sim`) in a child;
* :func:`start_router` / :func:`wait_router_ready`: ``miles-disagg router`` over given workers;
* :func:`stop_process`: SIGTERM, then SIGKILL if it does not exit in time;
* :func:`rss_mb` / :func:`cpu_s`: a process's memory and CPU time, from Linux ``/proc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def start_announcing(argv: list[str], log_path: Path, timeout_s: float, what: str) -> tuple[subprocess.Popen, bytes]:
    """Start ``argv`` (stderr to ``log_path``) and wait up to ``timeout_s`` for the first line it
    prints, which announces it is up; ``RuntimeError`` with the log's tail when none came."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log)
    line: list[bytes] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not line or not line[0]:
        proc.kill()
        raise RuntimeError(f"{what} did not start: {log_path.read_text(errors='replace')[-2000:]}")
    return proc, line[0]


def stop_process(proc: subprocess.Popen, timeout_s: float = 15.0) -> None:
    """SIGTERM, wait up to ``timeout_s``; then SIGKILL and wait up to 15 s more."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(15)


@dataclass
class SimFleetProcess:
    """``miles-disagg sim-engines`` in a child process: its handle and the engines' URLs."""

    proc: subprocess.Popen
    urls: list[str]

    @classmethod
    def start(cls, log_path: Path, num_engines: int, command: Any, timeout_s: float = 120.0) -> "SimFleetProcess":
        """``num_engines`` simulated engines timed by ``command``'s ``per_request_ms``, ``pull_ms`` and
        ``load_ms`` (a :class:`~miles_disagg.bench.scale.ScaleBench`); returns once it printed its URLs."""
        argv = [sys.executable, "-m", "miles_disagg.cli", "sim-engines", "--num-engines", str(num_engines),
                "--per-request-ms", str(command.per_request_ms), "--pull-ms", str(command.pull_ms),
                "--load-ms", str(command.load_ms)]
        proc, line = start_announcing(argv, log_path, timeout_s, "sim-engines")
        return cls(proc, json.loads(line)["urls"])

    def stop(self) -> None:
        stop_process(self.proc)


def start_router(root: Path, urls: list[str], num_engines: int):
    """``miles-disagg router`` over ``urls`` on a free port, logging to ``root/router-N.log``; its
    :func:`~miles_disagg.net.process.start_http_process` handle once ``/health`` answers."""
    from miles_disagg.net.process import free_port, start_http_process

    port = free_port()
    argv = [sys.executable, "-m", "miles_disagg.cli", "router", "--port", str(port)]
    for url in urls:
        argv += ["--worker", url]
    return start_http_process(argv, url=f"http://127.0.0.1:{port}", log_path=root / f"router-{num_engines}.log",
                              health_path="/health", what="router", error=RuntimeError, startup_timeout_s=120)


def wait_router_ready(url: str, num_engines: int, timeout_s: float = 120.0) -> None:
    """Wait until the router at ``url`` reports ``num_engines`` workers ready; ``RuntimeError`` after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/health", timeout=10, trust_env=False).json()
        if health.get("num_ready") == num_engines:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router sees {health} after {timeout_s}s, expected {num_engines} ready")
        time.sleep(0.2)


def rss_mb(pid: int) -> dict[str, float]:
    """Resident and peak resident memory of ``pid`` in MiB (Linux ``/proc``)."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return {"rss": fields.get("VmRSS"), "peak": fields.get("VmHWM")}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
