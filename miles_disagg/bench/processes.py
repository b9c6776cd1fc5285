"""The child processes of ``bench scale`` and what it reads of them.

* :func:`start_announcing`: start a child and wait for the line announcing it is up;
* :class:`SimFleetProcess`: ``miles-disagg sim-engines`` (:mod:`miles_disagg.bench.sim`) in one or more children;
* :func:`start_router` / :func:`wait_router_ready`: ``miles-disagg router`` over given workers (one or more
  processes: :func:`process_tree`);
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


ENGINES_PER_SIM_PROCESS = 256
"""``bench scale``'s simulated engines per simulator process (one event loop each): more would make the
simulator, not the control plane under test, what the updater and the router wait for."""


@dataclass
class SimFleetProcess:
    """``miles-disagg sim-engines`` in one or more child processes: their handles and the engines' URLs
    (in engine order; the engines split evenly over the processes)."""

    procs: list[subprocess.Popen]
    urls: list[str]

    @classmethod
    def start(cls, log_path: Path, num_engines: int, command: Any, timeout_s: float = 120.0,
              processes: int = 1, stock_activation: bool = False) -> "SimFleetProcess":
        """``num_engines`` simulated engines timed by ``command``'s ``per_request_ms``, ``pull_ms`` and
        ``load_ms`` (a :class:`~miles_disagg.bench.scale.ScaleBench`) in ``processes`` processes; returns
        once every process printed its URLs. ``stock_activation``: engines without one-call activation."""
        processes = max(1, min(processes, num_engines))
        counts = [num_engines // processes + (i < num_engines % processes) for i in range(processes)]
        procs, urls = [], []
        try:
            for index, count in enumerate(counts):
                argv = [sys.executable, "-m", "miles_disagg.cli", "sim-engines", "--num-engines", str(count),
                        "--per-request-ms", str(command.per_request_ms), "--pull-ms", str(command.pull_ms),
                        "--load-ms", str(command.load_ms), *(["--stock-activation"] if stock_activation else [])]
                path = log_path if processes == 1 else log_path.with_name(f"{log_path.stem}-{index}{log_path.suffix}")
                proc, line = start_announcing(argv, path, timeout_s, "sim-engines")
                procs.append(proc)
                urls += json.loads(line)["urls"]
        except BaseException:
            for proc in procs:
                stop_process(proc)
            raise
        return cls(procs, urls)

    @property
    def proc(self) -> subprocess.Popen:
        """The simulator process, for a fleet of one process."""
        if len(self.procs) != 1:
            raise ValueError(f"this fleet runs in {len(self.procs)} processes; use .procs")
        return self.procs[0]

    def cpu_s(self) -> list[float]:
        """CPU seconds so far of each simulator process."""
        return [cpu_s(proc.pid) for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc)


def start_router(root: Path, urls: list[str], num_engines: int, router_workers: int = 1):
    """``miles-disagg router`` over ``urls`` on a free port (``router_workers`` processes), logging to
    ``root/router-N[-wK].log``; its :func:`~miles_disagg.net.process.start_http_process` handle once
    ``/health`` answers."""
    from miles_disagg.net.process import free_port, start_http_process

    port = free_port()
    argv = [sys.executable, "-m", "miles_disagg.cli", "router", "--port", str(port)]
    if router_workers > 1:
        argv += ["--router-workers", str(router_workers)]
    for url in urls:
        argv += ["--worker", url]
    name = f"router-{num_engines}" + (f"-w{router_workers}" if router_workers > 1 else "")
    return start_http_process(argv, url=f"http://127.0.0.1:{port}", log_path=root / f"{name}.log",
                              health_path="/health", what="router", error=RuntimeError, startup_timeout_s=120)


def wait_router_ready(url: str, num_engines: int, timeout_s: float = 120.0, router_workers: int = 1) -> None:
    """Wait until the router at ``url`` reports ``num_engines`` workers ready and ``router_workers`` processes
    serving; ``RuntimeError`` after ``timeout_s``."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(url + "/health", timeout=10, trust_env=False).json()
        serving = health.get("router_workers", {}).get("serving", 1)
        if health.get("num_ready") == num_engines and serving == router_workers:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router sees {health} after {timeout_s}s, expected {num_engines} ready and "
                               f"{router_workers} processes serving")
        time.sleep(0.2)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``; a router's processes are its children)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return [pid]
    return [pid] + [p for child in children for p in process_tree(int(child))]


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
