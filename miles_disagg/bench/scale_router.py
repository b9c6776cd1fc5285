"""``bench scale``'s router section: ``miles-disagg router`` over each pool of simulated engines under load.

``--in-flight`` requests kept in flight for ``--duration`` seconds from one asyncio client
(:func:`generate_load`), ``--rounds`` windows per pool size, the sizes taking turns (a change of the
machine's load hits every size alike): requests/s, client latency p50/p99, the router's own time per
request (its ``/metrics`` ``routing_overhead_ms``), its CPU per request, the share of a core the router,
the simulated engines and the load client each used, the router's peak memory; before the load, the
share of a core the router uses idle (health checks of N workers alone, over ``--idle-measure`` seconds).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import time
from typing import Any

from miles_disagg.bench.common import progress
from miles_disagg.bench.processes import SimFleetProcess, cpu_s, rss_mb

_progress = progress("scale")
MAX_WARMUP_S = 120.0
GENERATE_BODY = {"input_ids": [11, 12, 13, 14], "sampling_params": {"max_new_tokens": 16, "temperature": 1.0},
                 "return_logprob": True}


def router_all(routers: dict[int, Any], fleets: dict[int, SimFleetProcess], command: Any) -> dict[int, dict]:
    """``--rounds`` rounds of one load window per size. Per size: medians over its windows;
    ``throughput_vs_smallest_per_round`` compares windows of the same round. ``cpu_cores``: the share of
    a core each process used in the window (the router, its simulated engines, this load client; each is
    one event loop, so near 1.0 is that process's limit, and the machine's cores bound their sum): the
    check that the figures are the router's, not the simulator's or the client's.
    ``router_idle_cpu_fraction``: health checks of N workers alone, before any load."""
    import httpx

    idle_before = {size: cpu_s(router.proc.pid) for size, router in routers.items()}
    time.sleep(command.idle_measure)  # no traffic anywhere: what health checking alone costs
    idle = {size: (cpu_s(router.proc.pid) - idle_before[size]) / command.idle_measure
            for size, router in routers.items()}
    windows: dict[int, list[dict]] = {size: [] for size in routers}
    for round_index in range(command.rounds):
        for size, router in routers.items():
            windows[size].append(_load_window(router, fleets[size], command, idle[size]))
            _progress(f"  router, {size} engines, round {round_index + 1}: {windows[size][-1]}")
    results = {}
    for size, router in routers.items():
        metrics = httpx.get(router.url + "/metrics", timeout=30, trust_env=False).json()
        results[size] = {**_router_summary(windows[size]), "router_idle_cpu_fraction": round(idle[size], 4),
                         "routing_overhead_ms": metrics.get("routing_overhead_ms"),
                         "router_rss_mb": rss_mb(router.proc.pid)}
    base = min(routers)
    for size in routers:
        results[size]["throughput_vs_smallest_per_round"] = [
            round(mine["requests_per_s"] / theirs["requests_per_s"], 3) if theirs["requests_per_s"] else None
            for mine, theirs in zip(windows[size], windows[base])]
    return results


def _load_window(router: Any, fleet: SimFleetProcess, command: Any, idle_cores: float) -> dict:
    """One load window. ``router_net_cpu_ms_per_request``: the router's CPU less what its health checks
    take idle (``idle_cores``), per request: on a starved machine few requests are served and the
    checks of 256 workers would otherwise read as routing cost."""
    from miles_disagg.net.pooled_http import run_loop

    pids = {"router": router.proc.pid, "sim_engines": fleet.proc.pid, "load_client": os.getpid()}
    before, started = {name: cpu_s(pid) for name, pid in pids.items()}, time.perf_counter()
    load = run_loop(generate_load(router.url + "/generate", command.in_flight, command.duration))
    elapsed = time.perf_counter() - started
    used = {name: cpu_s(pid) - before[name] for name, pid in pids.items()}
    served = load.pop("served_total")
    return {**load, "router_cpu_ms_per_request": round(1e3 * used["router"] / max(1, served), 3),
            "router_net_cpu_ms_per_request": round(1e3 * max(0.0, used["router"] - idle_cores * elapsed) / max(1, served), 3),
            "cpu_cores": {name: round(value / elapsed, 3) for name, value in used.items()},
            "load_avg_1m": round(os.getloadavg()[0], 2)}


def _router_summary(windows: list[dict]) -> dict:
    med = lambda values: round(statistics.median(values), 3) if values else None  # noqa: E731
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
