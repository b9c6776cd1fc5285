"""``bench scale``'s router section: ``miles-disagg router`` over each pool of simulated engines under load.

For each pool size and each ``--router-workers`` count, a router is started for its window alone (a router
left idle meanwhile would probe its pool, and at 1,024 engines those probes would compete for the cores
with the one measured), ``--in-flight`` requests are kept in flight for ``--duration`` seconds from one
asyncio client (:func:`generate_load`), and the router is stopped; ``--rounds`` such windows, the sizes
and counts taking turns (a change of the machine's load hits each alike). Per window: requests/s, client
latency p50/p99, the router's CPU per request (all its processes), the share of a core each process used
(the router's, its busiest process's, the simulators' and their busiest process's, the load client's: which
one was the limit); per router: its own time per request (``/metrics`` ``routing_overhead_ms``: time in the
router minus time waiting for engines), the memory of each of its processes, and, in the first round, the
share of a core it uses idle (health checks of N workers alone, over ``--idle-measure`` seconds).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import time
from typing import Any, Callable

from miles_disagg.bench.common import progress
from miles_disagg.bench.processes import SimFleetProcess, cpu_s, process_tree, rss_mb

_progress = progress("scale")
MAX_WARMUP_S = 120.0
GENERATE_BODY = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
                 "return_logprob": True}


class RouterRuns:
    """Every window of every (pool size, router-worker count), and what each router reported."""

    def __init__(self) -> None:
        self.windows: dict[tuple[int, int], list[dict]] = {}
        self.idle: dict[tuple[int, int], float] = {}
        self.last: dict[tuple[int, int], dict] = {}  # routing overhead and memory, from the latest router

    def measure(self, size: int, workers: int, router: Any, fleet: SimFleetProcess, command: Any,
                measure_idle: bool) -> None:
        """One window of ``router`` (started and ready; stopped by the caller)."""
        import httpx

        key = (size, workers)
        pids = process_tree(router.proc.pid)
        if measure_idle:
            before = sum(cpu_s(pid) for pid in pids)
            time.sleep(command.idle_measure)  # no traffic: what health checking alone costs
            self.idle[key] = (sum(cpu_s(pid) for pid in pids) - before) / command.idle_measure
        window = load_window(router.url, pids, fleet, command, self.idle.get(key, 0.0))
        self.windows.setdefault(key, []).append(window)
        _progress(f"  router, {size} engines, {workers} router process(es): {window}")
        metrics = httpx.get(router.url + "/metrics", timeout=60, trust_env=False).json()
        self.last[key] = {"routing_overhead_ms": metrics.get("routing_overhead_ms"), "router_rss_mb": rss_mb(pids[0]),
                          "router_processes_rss_mb": [rss_mb(pid) for pid in pids]}

    def results(self) -> dict[int, dict[int, dict]]:
        """Per pool size, per worker count: medians over its windows, and ``throughput_vs_smallest_per_round``
        (each window against the smallest pool's window of the same round and count)."""
        out: dict[int, dict[int, dict]] = {}
        base = min(size for size, _ in self.windows)
        for (size, workers), windows in self.windows.items():
            theirs = self.windows[(base, workers)]
            out.setdefault(size, {})[workers] = {
                "router_workers": workers, **summary(windows), **self.last[(size, workers)],
                "router_idle_cpu_fraction": round(self.idle.get((size, workers), 0.0), 4),
                "throughput_vs_smallest_per_round": [
                    round(a["requests_per_s"] / b["requests_per_s"], 3) if b["requests_per_s"] else None
                    for a, b in zip(windows, theirs)]}
        return out


def load_window(router_url: str, router_pids: list[int], fleet: SimFleetProcess, command: Any,
                idle_cores: float) -> dict:
    """One load window. ``router_net_cpu_ms_per_request``: the router's CPU less what its health checks
    take idle (``idle_cores``), per request: on a starved machine few requests are served and the
    checks of 1,024 workers would otherwise read as routing cost."""
    from miles_disagg.net.pooled_http import run_loop

    sims = [proc.pid for proc in fleet.procs]
    before, started = _cpu_of(router_pids, sims), time.perf_counter()
    load = run_loop(generate_load(router_url + "/generate", command.in_flight, command.duration))
    elapsed = time.perf_counter() - started
    after = _cpu_of(router_pids, sims)
    used: dict[str, Any] = {name: _minus(after[name], before[name]) for name in after}
    served = load.pop("served_total")
    router_s = sum(used["router"])
    cores = lambda seconds: round(seconds / elapsed, 3)  # noqa: E731
    return {**load, "router_cpu_ms_per_request": round(1e3 * router_s / max(1, served), 3),
            "router_net_cpu_ms_per_request": round(1e3 * max(0.0, router_s - idle_cores * elapsed) / max(1, served), 3),
            "cpu_cores": {"router": cores(router_s), "router_busiest_process": cores(max(used["router"])),
                          "sim_engines": cores(sum(used["sim_engines"])),
                          "sim_engines_busiest_process": cores(max(used["sim_engines"])),
                          "load_client": cores(used["load_client"][0])},
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def _cpu_of(router_pids: list[int], sim_pids: list[int]) -> dict[str, list[float]]:
    return {"router": [cpu_s(pid) for pid in router_pids], "sim_engines": [cpu_s(pid) for pid in sim_pids],
            "load_client": [time.process_time()]}


def _minus(after: list[float], before: list[float]) -> list[float]:
    return [a - b for a, b in zip(after, before)]


def summary(windows: list[dict]) -> dict:
    med: Callable = lambda values: round(statistics.median(values), 3) if values else None  # noqa: E731
    return {"requests_per_s": med([w["requests_per_s"] for w in windows]),
            "served": sum(w["served"] for w in windows),
            "errors": {k: sum(w["errors"].get(k, 0) for w in windows) for w in windows for k in w["errors"]},
            "latency_ms": {q: med([w["latency_ms"][q] for w in windows if w["latency_ms"][q] is not None])
                           for q in ("p50", "p99")},
            "router_cpu_ms_per_request": med([w["router_cpu_ms_per_request"] for w in windows]),
            "router_net_cpu_ms_per_request": med([w["router_net_cpu_ms_per_request"] for w in windows]),
            "cpu_cores": {name: med([w["cpu_cores"][name] for w in windows]) for name in windows[0]["cpu_cores"]},
            "windows": windows}


async def generate_load(url: str, in_flight: int, duration_s: float, warmup_s: float = 1.0,
                        body: dict | None = None) -> dict:
    """``in_flight`` requests kept in flight. The measured window of ``duration_s`` opens once ``warmup_s``
    has passed and ``in_flight`` answers have come back (every client turned over once), at the latest
    :data:`MAX_WARMUP_S` later: with thousands in flight on a busy machine the first answers come late, and
    a window opened before would measure the queue filling, not the router serving. Throughput counts the
    answers that arrived within the window (whenever they were sent); latencies are theirs."""
    import aiohttp

    payload = json.dumps(body or GENERATE_BODY).encode()
    headers = {"Content-Type": "application/json"}
    latencies: list[float] = []
    errors: dict[str, int] = {}
    loop = asyncio.get_running_loop()
    begin = loop.time()
    window = {"from": None, "to": math.inf}
    served_total = 0

    def measured(done: float) -> bool:
        """Whether an answer at ``done`` is in the window (opening it when the warm-up is over)."""
        if window["from"] is None:
            if (served_total >= in_flight and done >= begin + warmup_s) or done >= begin + warmup_s + MAX_WARMUP_S:
                window["from"], window["to"] = done, done + duration_s
            return False
        return done <= window["to"]

    async def client(session) -> None:
        nonlocal served_total
        while loop.time() < window["to"]:
            sent = loop.time()
            try:
                async with session.post(url, data=payload, headers=headers) as response:
                    await response.read()
                    status = response.status
            except aiohttp.ClientError as exc:
                status = type(exc).__name__
            done = loop.time()
            served_total += 1
            if measured(done):
                if status == 200:
                    latencies.append(done - sent)
                else:
                    errors[str(status)] = errors.get(str(status), 0) + 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as session:
        await asyncio.gather(*(client(session) for _ in range(in_flight)))
    latencies.sort()
    at = lambda q: round(1e3 * latencies[min(len(latencies) - 1, int(q * len(latencies)))], 2) if latencies else None  # noqa: E731
    return {"requests_per_s": round(len(latencies) / duration_s, 1), "served": len(latencies), "errors": errors,
            "latency_ms": {"p50": at(0.5), "p99": at(0.99)}, "warmup_s": round(window["from"] - begin, 2),
            "served_total": served_total}
