"""``miles-disagg bench scale --engines 8,64,256,1024``: the control plane against pools of simulated engines.

For each pool size N, with N simulated engines (:mod:`miles_disagg.bench.sim.engines`, one port each, in one
simulator process per :data:`~miles_disagg.bench.processes.ENGINES_PER_SIM_PROCESS` engines, or
``--sim-processes``). Every size's fleet runs for the whole bench and the sizes take turns, update after update
and load window after load window, so a change in the machine's load (it is shared) hits every size alike:

* ``fanout``: the disk-delta updater (:class:`~miles_disagg.engines.updater.DiskDeltaUpdater`, the
  run's own) bringing all N engines to a new version, ``--updates`` times: the whole update, its
  prepare phase (``/pull_weights`` everywhere) and activate phase, the longest pause of one engine, the
  updater's CPU and the simulators' (their headroom: their total and their busiest process). Medians over
  the updates. ``threads`` (up to :data:`THREADS_BASELINE_MAX_ENGINES` engines): each update is followed by
  one done as before (a thread and a synchronous client per engine), so the two are compared side by side.
  The simulated engines announce one-call activation (``/activate_weights``, as the built-in engine and the
  agent do); ``fanout_per_step`` is the same measurement over N engines that do not (stock SGLang attached
  directly: the updater's per-step activation, five requests per engine, at most
  :data:`~miles_disagg.engines.updater.MAX_STEPPING_AT_ONCE` engines paused at once), in turn with the other
  (``--fanout-activation``).
* ``router``: ``miles-disagg router`` with each ``--router-workers`` count over the N engines, started for
  its window alone, ``--in-flight`` requests kept in flight for ``--duration`` seconds from one asyncio
  client, ``--rounds`` windows (:mod:`miles_disagg.bench.scale_router`): requests/s, client latency p50/p99,
  the router's own time per request (p50/p99), its CPU per request, the share of a core each process used
  (which one was the limit), each router process's memory; in the first round the share of a core it uses
  idle (health checks of N workers alone). ``router`` holds the first count's figures,
  ``router_by_workers`` every count's.
* ``rollout``: the rollout manager (:class:`~miles_disagg.rollout.manager.RolloutManager`, in this
  process, the built-in count-up task on a digits tokenizer) producing through the same router (the first
  count) at ``--rollout-concurrency`` requests in flight whatever the pool size, the trainer's side taking
  batches for ``--duration`` seconds, ``--rounds`` times: samples/s, and this process's memory (it holds
  the manager).

* ``service`` (only when asked: ``--sections service``): the rollout service's gateway and
  ``--service-replicas`` replicas (the service's own code, one simulated engine each): seconds from a
  version's commit in the store until every replica serves it, the gateway's and replicas' CPU and
  memory (:mod:`miles_disagg.bench.scale_service`); a top-level ``service`` key, apart from ``pools``.
  About 20 s and 20 CPU-s with 64 replicas and 5 versions on 2 cores; kept out of the default set so that
  the default's JSON and its cost stay as they were.

``ratios`` compares each size with the smallest (per router-worker count too) and each count with the first.
The simulated engines answer ``/generate`` after ``--per-request-ms``; ``/pull_weights`` takes ``--pull-ms``,
``/update_weights_from_disk`` ``--load-ms``. Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_disagg.bench.common import print_result, progress, work_dir
from miles_disagg.bench.processes import (ENGINES_PER_SIM_PROCESS, SimFleetProcess, rss_mb, start_router,
                                          wait_router_ready)
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

_progress = progress("scale")
SECTIONS = ("fanout", "router", "rollout", "service")
ACTIVATION_PATHS = ("one-call", "per-step")
POOL_SECTIONS = ("fanout", "router", "rollout")
THREADS_BASELINE_MAX_ENGINES = 256  # a thread per engine beyond this measures the machine's threads, not the updater


@dataclass(kw_only=True)
class ScaleBench:
    """control plane at scale: fan-out, router throughput/overhead, memory, with simulated engines"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    engines: str = flag("8,64,256,1024", "Pool sizes, comma-separated.", metavar="N,N,...")
    router_workers: str = flag("1,2", "Router process counts measured per pool size (--router-workers of "
                               "miles-disagg router), comma-separated; the first also serves the rollout section.",
                               metavar="N,N,...")
    sim_processes: int = flag(0, "Simulator processes per pool (0: one per 256 engines).", metavar="N")
    updates: int = flag(3, "Weight updates timed per pool size (medians reported).")
    in_flight: int = flag(1024, "Requests kept in flight against the router.")
    duration: float = flag(8.0, "Seconds of one measured router load window (after a 1 s warm-up).", metavar="S")
    rounds: int = flag(3, "Router load windows per pool size, the sizes taking turns (medians reported).")
    per_request_ms: float = flag(20.0, "Simulated /generate time.", metavar="MS")
    pull_ms: float = flag(100.0, "Simulated /pull_weights time.", metavar="MS")
    load_ms: float = flag(50.0, "Simulated /update_weights_from_disk time.", metavar="MS")
    rollout_concurrency: int = flag(256, "The rollout manager's --rollout-concurrency (equal for every pool).")
    fanout_activation: str = flag("one-call,per-step", "fanout: the activation paths measured, comma-separated: "
                                  "one-call (engines that announce /activate_weights) and per-step (engines that do "
                                  "not, as stock SGLang attached directly).", metavar="PATH,PATH")
    sections: str = flag("fanout,router,rollout", "What to measure, comma-separated: fanout, router, rollout, "
                         "service (the rollout service's convergence with --service-replicas; not in the default set).")
    service_replicas: int = flag(64, "service: replicas, each attached to its own simulated engine.", metavar="N")
    service_versions: int = flag(3, "service: versions published one after another (p50/max reported).")
    service_poll_interval: float = flag(0.5, "service: the replicas' store polling and heartbeat interval.",
                                        metavar="S")
    idle_measure: float = flag(3.0, "Seconds of each idle measurement (the routers' health checks alone; the service's "
                               "heartbeats and health checks alone).", metavar="S")
    work_dir: Path | None = flag(None, "Keep logs here (default: a temp dir).")

    def __post_init__(self) -> None:
        if self.rounds < 1 or self.updates < 1:
            raise ValueError(f"--rounds and --updates must be >= 1, got {self.rounds}, {self.updates}")
        if self.service_replicas < 1 or self.service_versions < 1 or not self.service_poll_interval > 0:
            raise ValueError("--service-replicas and --service-versions must be >= 1 and --service-poll-interval > 0, "
                             f"got {self.service_replicas}, {self.service_versions}, {self.service_poll_interval}")
        if not self.idle_measure > 0:
            raise ValueError(f"--idle-measure must be > 0, got {self.idle_measure}")
        if not self.pool_sizes() or min(self.pool_sizes()) < 1:
            raise ValueError(f"--engines must list positive pool sizes, got {self.engines!r}")
        if not self.worker_counts() or min(self.worker_counts()) < 1 or self.sim_processes < 0:
            raise ValueError(f"--router-workers must list positive counts and --sim-processes be >= 0, got "
                             f"{self.router_workers!r}, {self.sim_processes}")
        unknown = set(self.section_names()) - set(SECTIONS)
        if unknown:
            raise ValueError(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
        paths = self.activation_paths()
        if not paths or set(paths) - set(ACTIVATION_PATHS):
            raise ValueError(f"--fanout-activation must list {' and/or '.join(ACTIVATION_PATHS)}, got "
                             f"{self.fanout_activation!r}")

    def activation_paths(self) -> list[str]:
        return [part.strip() for part in self.fanout_activation.split(",") if part.strip()]

    def pool_sizes(self) -> list[int]:
        try:
            return [int(part) for part in self.engines.split(",") if part.strip()]
        except ValueError:
            raise ValueError(f"--engines must be comma-separated integers, got {self.engines!r}") from None

    def worker_counts(self) -> list[int]:
        try:
            return list(dict.fromkeys(int(part) for part in self.router_workers.split(",") if part.strip()))
        except ValueError:
            raise ValueError(f"--router-workers must be comma-separated integers, got {self.router_workers!r}") \
                from None

    def sim_processes_for(self, size: int) -> int:
        return self.sim_processes or -(-size // ENGINES_PER_SIM_PROCESS)

    def section_names(self) -> list[str]:
        return [part.strip() for part in self.sections.split(",") if part.strip()]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ScaleBench)


def run(args: argparse.Namespace) -> int:
    command = config_from_args(ScaleBench, args)
    from miles_disagg.net.auth import ADMIN_API_KEY_ENV, new_key

    os.environ.setdefault(ADMIN_API_KEY_ENV, new_key())  # every process of the bench shares one admin key
    result: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0]},
                              "settings": _settings(command)}
    with work_dir("scale", command.work_dir) as root:
        if set(POOL_SECTIONS) & set(command.section_names()):
            per_size = _all_pools(root, command)
            result.update(pools=per_size, ratios=_ratios(per_size))
        if "service" in command.section_names():
            from miles_disagg.bench.scale_service import service_section

            result["service"] = service_section(root, command)
    return print_result(result)


def _settings(command: ScaleBench) -> dict:
    return {"in_flight": command.in_flight, "rollout_concurrency": command.rollout_concurrency,
            "duration_s": command.duration, "rounds": command.rounds, "updates": command.updates,
            "per_request_ms": command.per_request_ms, "pull_ms": command.pull_ms, "load_ms": command.load_ms,
            "fanout_activation": command.activation_paths(),
            "router_workers": command.worker_counts(),
            "sim_processes": {size: command.sim_processes_for(size) for size in command.pool_sizes()}}


def _all_pools(root: Path, command: ScaleBench) -> dict[int, dict]:
    """Every pool size's fleet runs for the whole bench; fan-out updates and router load windows take
    turns between the sizes (round after round), so a change of the machine's load hits every size."""
    sizes, sections = command.pool_sizes(), command.section_names()
    fanout_paths = command.activation_paths() if "fanout" in sections else []
    fleets: dict[int, SimFleetProcess] = {}
    stock: dict[int, SimFleetProcess] = {}  # engines without one-call activation (the per-step fan-out)
    try:
        for size in sizes:
            _progress(f"starting {size} simulated engines in {command.sim_processes_for(size)} process(es)")
            if "one-call" in fanout_paths or {"router", "rollout"} & set(sections):
                fleets[size] = SimFleetProcess.start(root / f"sim-{size}.log", size, command,
                                                     processes=command.sim_processes_for(size))
            if "per-step" in fanout_paths:
                stock[size] = SimFleetProcess.start(root / f"sim-stock-{size}.log", size, command,
                                                    processes=command.sim_processes_for(size), stock_activation=True)
        per_size: dict[int, dict] = {size: {"num_engines": size} for size in sizes}
        if fanout_paths:
            _fanout_sections(root, fleets if "one-call" in fanout_paths else {}, stock, command.updates, per_size)
        if {"router", "rollout"} & set(sections):
            _router_sections(root, fleets, command, per_size)
        for size in sizes:
            memory = [rss_mb(proc.pid) for proc in (fleets.get(size) or stock[size]).procs]
            per_size[size]["sim_engines_rss_mb"] = memory[0] if len(memory) == 1 else memory
        return per_size
    finally:
        for fleet in [*fleets.values(), *stock.values()]:
            fleet.stop()


def _fanout_sections(root: Path, fleets: dict[int, SimFleetProcess], stock: dict[int, SimFleetProcess], updates: int,
                     per_size: dict[int, dict]) -> None:
    """``fanout`` over the engines that announce one-call activation, ``fanout_per_step`` over those that
    do not (no threaded baseline there: the per-step path is what is measured)."""
    for key, pools, threads in (("fanout", fleets, True), ("fanout_per_step", stock, False)):
        if pools:
            for size, result in _fanout_all(root, pools, updates, threads=threads, name=key).items():
                per_size[size][key] = result


def _router_sections(root: Path, fleets: dict[int, SimFleetProcess], command: ScaleBench,
                     per_size: dict[int, dict]) -> None:
    """Round after round, per pool size, per router-worker count: a router started for its windows alone
    (the router section's load window; with the first count also the rollout section's), then stopped."""
    from miles_disagg.bench.scale_rollout import RolloutRuns
    from miles_disagg.bench.scale_router import RouterRuns

    counts, sections = command.worker_counts(), command.section_names()
    routers, rollouts = RouterRuns(), RolloutRuns(root) if "rollout" in sections else None
    for round_index in range(command.rounds):
        for size, fleet in fleets.items():
            for workers in counts:
                router = start_router(root, fleet.urls, size, router_workers=workers)
                try:
                    wait_router_ready(router.url, size, router_workers=workers)
                    if "router" in sections:
                        routers.measure(size, workers, router, fleet, command, measure_idle=round_index == 0)
                    if rollouts is not None and workers == counts[0]:
                        rollouts.measure(size, router.url, command)
                finally:
                    router.stop()
    if "router" in sections:
        for size, by_workers in routers.results().items():
            per_size[size]["router"] = by_workers[counts[0]]
            per_size[size]["router_by_workers"] = {str(n): result for n, result in by_workers.items() if n != counts[0]}
    if rollouts is not None:
        for size, result in rollouts.results(command).items():
            per_size[size]["rollout"] = result


# --------------------------------------------------------------------------- fan-out


def _fanout_all(root: Path, fleets: dict[int, SimFleetProcess], updates: int, *, threads: bool = True,
                name: str = "fanout") -> dict[int, dict]:
    """``updates`` rounds; in each, every pool size gets one update by the updater (one event loop) and
    then one the way it was done before (a thread and a synchronous client per engine: its public
    per-engine steps). ``sim_engines_cpu_s``: the simulated engines' CPU per update (their process is one
    event loop: far less than one core over the update's seconds means they are not what it waits for)."""
    from miles_disagg.engines.updater import DiskDeltaUpdater

    updaters = {size: DiskDeltaUpdater(fleet.urls, store_dir=str(root / f"store-{name}-{size}"),
                                       local_dirs=[str(root / f"{name}-{size}" / f"engine-{i}")
                                                   for i in range(size)])
                for size, fleet in fleets.items()}
    loop_runs: dict[int, list] = {size: [] for size in fleets}
    thread_runs: dict[int, list] = {size: [] for size in fleets}
    with_threads = threads
    threads = {size: with_threads and size <= THREADS_BASELINE_MAX_ENGINES for size in fleets}
    try:
        for size, updater in updaters.items():
            _loop_update(updater, 1)  # warm-up (imports, first connections): not measured
            if threads[size]:
                _threaded_update(updater, 2)
        for version in range(3, 2 * updates + 3, 2):
            for size, updater in updaters.items():
                fleet = fleets[size]
                loop_runs[size].append(_timed(lambda: _loop_update(updater, version), fleet))
                if threads[size]:
                    thread_runs[size].append(_timed(lambda: _threaded_update(updater, version + 1), fleet))
                else:  # the version the threaded update would have brought, so versions stay in step
                    _loop_update(updater, version + 1)
    finally:
        for updater in updaters.values():
            updater.close()
    results = {size: {**_fanout_summary(loop_runs[size], thread_runs[size]),
                      "updater_process_rss_mb": rss_mb(os.getpid())} for size in fleets}
    for size, result in results.items():
        _progress(f"  {name}, {size} engines: {result}")
    return results


def _fanout_summary(loop_runs: list[dict], thread_runs: list[dict]) -> dict:
    med = lambda values: round(statistics.median(values), 4)  # noqa: E731
    return {"update_s": med([r["update_s"] for r in loop_runs]),
            "prepare_s": med([r["prepare_s"] for r in loop_runs]),
            "activate_s": med([r["activate_s"] for r in loop_runs]),
            "max_pause_s": med([r["max_pause_s"] for r in loop_runs]),
            "updater_cpu_s": med([r["cpu_s"] for r in loop_runs]),
            "sim_engines_cpu_s": med([r["sim_cpu_s"] for r in loop_runs]),
            "sim_engines_busiest_process_cpu_s": med([r["sim_busiest_cpu_s"] for r in loop_runs]),
            "threads": {"update_s": med([r["update_s"] for r in thread_runs]),
                        "max_pause_s": med([r["max_pause_s"] for r in thread_runs]),
                        "updater_cpu_s": med([r["cpu_s"] for r in thread_runs])} if thread_runs else None}


def _timed(run, fleet: SimFleetProcess) -> dict:
    start, cpu_start, sim_start = time.perf_counter(), time.process_time(), fleet.cpu_s()
    prepare_s, activate_s, max_pause_s = run()
    sim_used = [after - before for after, before in zip(fleet.cpu_s(), sim_start)]
    return {"update_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start,
            "sim_cpu_s": sum(sim_used), "sim_busiest_cpu_s": max(sim_used),
            "prepare_s": prepare_s, "activate_s": activate_s, "max_pause_s": max_pause_s}


def _loop_update(updater, version: int) -> tuple[float, float, float]:
    report = updater.update(version)
    return report.prepare_time_s, report.activate_time_s, report.pause_time_s


def _threaded_update(updater, version: int) -> tuple[float, float, float]:
    from concurrent.futures import ThreadPoolExecutor

    indices = range(len(updater.clients))
    with ThreadPoolExecutor(len(updater.clients)) as pool:
        start = time.perf_counter()
        list(pool.map(lambda i: updater.prepare(i, version), indices))
        prepared = time.perf_counter()
        pauses = list(pool.map(lambda i: updater.activate(i, version), indices))
    return prepared - start, time.perf_counter() - prepared, max(pauses)


# --------------------------------------------------------------------------- ratios


def _ratios(per_size: dict[int, dict]) -> dict:
    """Each pool size against the smallest: fan-out time and longest pause, router throughput (per
    router-worker count too) and CPU per request, rollout samples/s; per size, the event-loop fan-out
    against the threaded one, and each router-worker count against the first."""
    base_size = min(per_size)
    base = per_size[base_size]
    ratios: dict = {}
    for size, result in per_size.items():
        if result.get("fanout", {}).get("threads"):
            loop, threads = result["fanout"], result["fanout"]["threads"]
            ratios[f"fanout_loop_vs_threads_{size}"] = {
                "update_time": round(loop["update_s"] / threads["update_s"], 3),
                "updater_cpu": round(loop["updater_cpu_s"] / max(threads["updater_cpu_s"], 1e-9), 3)}
        if result.get("router_by_workers"):
            first = result["router"]
            ratios[f"router_workers_{size}"] = {
                f"{n}_vs_{first['router_workers']}": {
                    "throughput": _ratio(theirs["requests_per_s"], first["requests_per_s"]),
                    "cpu_per_request": _ratio(theirs["router_cpu_ms_per_request"], first["router_cpu_ms_per_request"])}
                for n, theirs in result["router_by_workers"].items()}
    for size, result in per_size.items():
        if size != base_size:
            ratios[f"{size}_vs_{base_size}"] = _versus_smallest(result, base)
    return ratios


def _versus_smallest(result: dict, base: dict) -> dict:
    entry: dict[str, Any] = {}
    if "fanout_per_step" in result:
        mine, theirs = result["fanout_per_step"], base["fanout_per_step"]
        entry["fanout_per_step_update_time_vs_smallest"] = _ratio(mine["update_s"], theirs["update_s"])
        entry["fanout_per_step_max_pause_vs_smallest"] = _ratio(mine["max_pause_s"], theirs["max_pause_s"])
    if "fanout" in result:
        entry["fanout_update_time_vs_smallest"] = _ratio(result["fanout"]["update_s"], base["fanout"]["update_s"])
        entry["fanout_max_pause_vs_smallest"] = _ratio(result["fanout"]["max_pause_s"], base["fanout"]["max_pause_s"])
        if result["fanout"]["threads"] and base["fanout"]["threads"]:
            entry["fanout_threads_update_time_vs_smallest"] = _ratio(result["fanout"]["threads"]["update_s"],
                                                                     base["fanout"]["threads"]["update_s"])
    if "router" in result:
        mine, theirs = result["router"], base["router"]
        entry["router_throughput_vs_smallest"] = _ratio(mine["requests_per_s"], theirs["requests_per_s"])
        per_round = [r for r in mine["throughput_vs_smallest_per_round"] if r is not None]
        entry["router_throughput_vs_smallest_median_of_rounds"] = (
            round(statistics.median(per_round), 3) if per_round else None)
        entry["router_cpu_per_request_vs_smallest"] = _ratio(mine["router_cpu_ms_per_request"],
                                                             theirs["router_cpu_ms_per_request"])
        entry["router_net_cpu_per_request_vs_smallest"] = _ratio(mine["router_net_cpu_ms_per_request"],
                                                                 theirs["router_net_cpu_ms_per_request"])
        entry["router_throughput_vs_smallest_by_workers"] = {
            str(mine["router_workers"]): entry["router_throughput_vs_smallest"],
            **{n: _ratio(r["requests_per_s"], base["router_by_workers"][n]["requests_per_s"])
               for n, r in result.get("router_by_workers", {}).items()}}
    if "rollout" in result:
        entry["rollout_samples_per_s_vs_smallest"] = _ratio(result["rollout"]["samples_per_s"],
                                                            base["rollout"]["samples_per_s"])
        per_round = [mine / theirs for mine, theirs in zip(result["rollout"]["samples_per_s_per_round"],
                                                           base["rollout"]["samples_per_s_per_round"]) if theirs]
        entry["rollout_samples_per_s_vs_smallest_median_of_rounds"] = (
            round(statistics.median(per_round), 3) if per_round else None)
    return entry


def _ratio(mine: float | None, theirs: float | None) -> float | None:
    return round(mine / theirs, 3) if mine is not None and theirs else None
