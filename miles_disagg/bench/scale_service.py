"""``bench scale``'s service section: the rollout service's convergence time with many replicas.

The service's own code throughout: ``miles-disagg serve gateway`` (its own process), and
``--service-replicas`` :class:`~miles_disagg.service.replica.Replica` agents (reconciler, heartbeats,
control API), each attached to one simulated engine (``--engine url:`` as ``serve replica`` does) - the
engine is the only stand-in. The replicas share one process (one thread set each), because 64 replica
processes would not fit on a small machine; nothing in a replica knows it has neighbours. Versions are
published into a real version store (a tiny one-tensor checkpoint, so the publication itself is cheap) one
after another, each once every replica serves the previous one; nobody calls ``/wake``: replicas find a
version by polling the store (``--service-poll-interval``), as they do when a trainer publishes.

Reported: per version, the gateway's convergence (seconds from the version's commit in the store - its
index time - until 50% / 100% of the replicas advertise it) and the client's view (the publish call
returned -> the gateway lists every replica ready at it); p50/max over versions; the time from launch
until every replica was ready; the share of a core and the memory of the gateway, the replicas' process
and the simulated engines, idle (heartbeats and health checks only, ``--idle-measure`` seconds) and while
versions roll out.

Run as ``python -m miles_disagg.bench.scale_service``, this module is that replicas' process.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from miles_disagg.bench.common import progress
from miles_disagg.bench.processes import SimFleetProcess, cpu_s, rss_mb, start_announcing, stop_process

_progress = progress("scale")
HEARTBEAT_TIMEOUT_S = 10.0
STARTUP_TIMEOUT_S = 300.0
CONVERGE_TIMEOUT_S = 120.0


def service_section(root: Path, command: Any) -> dict:
    """Start the simulated engines, a store, the gateway and the replicas; publish; measure; stop."""
    from miles_disagg.service.client import GatewayClient
    from miles_disagg.service.launch import launch_gateway

    size = command.service_replicas
    root = root / "service"
    root.mkdir(parents=True, exist_ok=True)
    source = TinySource(root / "store", root / "base")
    source.publish()  # replicas start by catching up to v1
    _progress(f"service: starting {size} simulated engines, the gateway and {size} replicas")
    fleet = SimFleetProcess.start(root / "sim-engines.log", size, command)
    gateway = host = client = None
    try:
        gateway = launch_gateway(log_path=root / "gateway.log", health_check_interval_s=0.5,
                                 heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
        started = time.monotonic()
        host = ReplicaHost.start(root, gateway.url, fleet.urls, command)
        client = GatewayClient(gateway.url, timeout_s=60.0)
        client.wait_converged(1, num_replicas=size, timeout_s=STARTUP_TIMEOUT_S)
        startup_s = time.monotonic() - started
        pids = {"gateway": gateway.proc.pid, "replicas": host.proc.pid, "sim_engines": fleet.proc.pid}
        idle = _cores_used(pids, lambda: time.sleep(command.idle_measure))
        client_s: dict[str, float] = {}

        def roll_out() -> None:
            for _ in range(command.service_versions):
                version = source.publish()
                published = time.monotonic()
                client.wait_converged(version, num_replicas=size, timeout_s=CONVERGE_TIMEOUT_S)
                client_s[str(version)] = round(time.monotonic() - published, 4)
                _progress(f"  service, {size} replicas: v{version} everywhere after {client_s[str(version)]} s")

        rolling = _cores_used(pids, roll_out)
        metrics, replicas = client.metrics(), client.replicas()
        memory = {name: rss_mb(pid) for name, pid in pids.items()}
    finally:
        if client is not None:
            client.close()
        for part in (host, gateway, fleet):
            if part is not None:
                part.stop()
        source.close()
    return _report(command, source.published[1:], metrics, replicas, client_s, startup_s,
                   {"idle": idle, "rolling_out": rolling}, memory)


def _report(command: Any, versions: list[int], metrics: dict, replicas: list[dict], client_s: dict,
            startup_s: float, cores: dict, memory: dict) -> dict:
    size = command.service_replicas
    tracked = metrics["convergence"]["versions"]
    gateway_s = {str(v): {k: _round(s) for k, s in (tracked.get(str(v), {}).get("converged_s") or {}).items()}
                 for v in versions}
    full = [c["1"] for c in gateway_s.values() if c.get("1") is not None]
    pauses = [a["pause_s"] for r in metrics["replicas"] for a in r["activations"]]
    prepares = [a["prepare_s"] for r in metrics["replicas"] for a in r["activations"]]
    newest = versions[-1]
    return {
        "num_replicas": size, "versions": versions,
        "poll_interval_s": command.service_poll_interval, "heartbeat_interval_s": command.service_poll_interval,
        "replicas_converged": sum(r["state"] == "ready" and r["weight_version"] == newest and not r["lost"]
                                  for r in replicas),
        "replicas_registered": len(replicas),
        "startup_to_all_ready_s": round(startup_s, 3),
        "convergence_s": gateway_s,
        "convergence_s_p50": _round(statistics.median(full)) if full else None,
        "convergence_s_max": _round(max(full)) if full else None,
        "client_convergence_s": client_s,
        "client_convergence_s_p50": _round(statistics.median(client_s.values())) if client_s else None,
        "client_convergence_s_max": _round(max(client_s.values())) if client_s else None,
        "pause_s_max": _round(max(pauses)) if pauses else None,
        "prepare_s_mean": _round(statistics.fmean(prepares)) if prepares else None,
        "cpu_cores": cores,
        "rss_mb": memory,
        "replicas_rss_mb_per_replica": _round(memory["replicas"]["rss"] / size, 2),
    }


def _cores_used(pids: dict[str, int], work) -> dict[str, float]:
    """Run ``work``; the share of a core each process used meanwhile (CPU seconds / wall seconds)."""
    before, start = {name: cpu_s(pid) for name, pid in pids.items()}, time.perf_counter()
    work()
    wall = time.perf_counter() - start
    return {name: round((cpu_s(pid) - before[name]) / wall, 3) for name, pid in pids.items()} | {"wall_s": round(wall, 3)}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


class TinySource:
    """A version store fed from a one-tensor checkpoint: publication is the service's trigger, and
    cheap here (the simulated engines do not read the versions; their pull time is simulated)."""

    def __init__(self, store_dir: Path, base_dir: Path):
        import torch
        from safetensors.torch import save_file

        from miles_disagg.weights.publisher import DeltaPublisher

        base_dir.mkdir(parents=True, exist_ok=True)
        self.tensor = torch.zeros(1024, dtype=torch.float32)
        save_file({"model.embed_tokens.weight": self.tensor}, str(base_dir / "model.safetensors"))
        self.publisher = DeltaPublisher(store_dir, base_dir=base_dir, num_workers=1)
        self.publisher.capture_baseline()
        self.published: list[int] = []

    def publish(self) -> int:
        self.tensor = self.tensor + 1.0
        self.published.append(self.publisher.publish([("model.embed_tokens.weight", self.tensor)]).ref.version)
        return self.published[-1]

    def close(self) -> None:
        self.publisher.close()


class ReplicaHost:
    """The replicas' process (this module's ``__main__``), started and stopped by the bench."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    @classmethod
    def start(cls, root: Path, gateway_url: str, engine_urls: list[str], command: Any,
              timeout_s: float = 120.0) -> "ReplicaHost":
        argv = [sys.executable, "-m", "miles_disagg.bench.scale_service", "--gateway", gateway_url,
                "--store", str(root / "store"), "--base-dir", str(root / "base"), "--work-dir", str(root / "replicas"),
                "--poll-interval", str(command.service_poll_interval), *engine_urls]
        proc, _ = start_announcing(argv, root / "replicas.log", timeout_s, "the replicas")
        return cls(proc)

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM: every replica drains and deregisters, as ``serve replica`` does."""
        stop_process(self.proc, timeout_s)


# --------------------------------------------------------------------------- the replicas' process


def _replica(index: int, engine_url: str, args: argparse.Namespace):
    from miles_disagg.engines.launch import EngineSpec
    from miles_disagg.service.replica import Replica, ReplicaConfig

    local = args.work_dir / f"replica-{index}" / "local-checkpoint"
    engine = EngineSpec(backend="builtin", model_path=args.base_dir.resolve(), local_checkpoint_dir=local,
                        store_dir=args.store.resolve(), log_dir=local.parent / "logs")
    return Replica(ReplicaConfig(replica_id=f"sim-{index}", store_dir=args.store, gateway_url=args.gateway,
                                 engine=engine, attach_url=engine_url, poll_interval_s=args.poll_interval,
                                 heartbeat_interval_s=args.poll_interval, drain_timeout_s=5.0))


def main(argv: list[str] | None = None) -> int:
    """Run one replica per engine URL, each in its own threads, until SIGTERM/SIGINT (then all drain)."""
    parser = argparse.ArgumentParser(prog="python -m miles_disagg.bench.scale_service")
    parser.add_argument("--gateway", required=True)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--base-dir", type=Path, required=True)
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--poll-interval", type=float, default=0.5)
    parser.add_argument("engine_urls", nargs="+")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    replicas = [_replica(i, url, args) for i, url in enumerate(args.engine_urls)]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    threads = [threading.Thread(target=r.run, name=r.replica_id, daemon=True) for r in replicas]
    for thread in threads:
        thread.start()
    print(json.dumps({"replicas": [r.replica_id for r in replicas]}), flush=True)
    while not stop.wait(0.5):
        pass
    for replica in replicas:
        replica.stop()
    deadline = time.monotonic() + 30.0
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
