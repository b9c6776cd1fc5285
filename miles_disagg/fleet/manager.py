"""The engine manager (a Ray actor): launches or attaches engines, runs the router, updates
weights, and replaces failed engines.

Managed: one ``EngineProcess`` actor per engine group of bundles (built-in engine, or SGLang
behind ``miles-disagg agent``). Attached (``--rollout-external``): nothing is launched; each
address must answer and match the job (architecture, tp size, context length, dtype), else
``ConfigError`` naming the field and both values. Either way every engine is registered with
the version-aware router that this actor starts.

Placement: the manager, and the router it starts, run on the driver's node. Every server binds
the address :func:`miles_disagg.net.netbind.bind_host` gives: loopback while the job is on one node,
the node's IP once it spans nodes. Before any engine starts, each engine's node reads the
trainer's store probe back (:meth:`EngineManager.start` with ``store_probe``) and looks for the
base checkpoint: a path an engine's node cannot read fails the run (``ConfigError``, exit 2)
naming that node and the path.

Faults: a monitor thread watches the engines. A managed engine whose process died is taken
out of the router at once, restarted, brought to the current version (base + chain through
``/pull_weights``) and only then registered again. An attached engine that stops answering
is removed; when it answers again it is re-checked and brought to the current version
before it is registered again. An engine whose node left the cluster (Ray says so: no
health-check timeout is waited for) or whose actor is gone is taken out at once and placed
again on its bundle when the cluster offers the resources (:mod:`miles_disagg.fleet.replace`),
caught up and verified before it is routed to. Weight updates and restores never interleave
(one lock). The monitor feeds the number of serving engines to the run's capacity policy
(:mod:`miles_disagg.fleet.capacity`: ``--min-rollout-engines``).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.fleet.capacity import CapacityPolicy
from miles_disagg.engines.client import EngineClient
from miles_disagg.fleet.plan import local_checkpoint_root
from miles_disagg.fleet.replace import Replacements, verify_served_version
from miles_disagg.engines.updater import BroadcastUpdater, DiskDeltaUpdater, UpdateFailed
from miles_disagg.types import ConfigError, EngineUnrecoverable, MilesDisaggError

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 120.0


class EngineManager:
    def __init__(self, config: EngineManagerConfig, placement=None):
        self.config = config
        self.cluster, self.rollout, self.weights = config.cluster, config.rollout, config.weights
        self.model_path, self.run_dir, self.seed = config.model_path, Path(config.run_dir), config.seed
        self.placement = placement
        self.sglang_args = dict(config.sglang_args)
        self.router = None
        self.router_client = None
        self.engine_urls: list[str] = []
        self.local_dirs: list[str] = []
        self._actors: list[Any] = []
        self._lock = threading.RLock()
        self._version = 0
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self.events: list[dict] = []
        self._down: set[int] = set()  # engine indices out of the router until restored
        self._failures: dict[int, int] = {}  # consecutive failed health checks per engine
        self._lost: set[int] = set()  # engines whose actor is gone (with its node): placed again, not restarted
        self._broadcast: BroadcastUpdater | None = None
        from miles_disagg.fleet.membership import Membership

        self.members = Membership(self)  # engines joining and leaving mid-run (engines add/remove)
        self._control = None  # the membership control endpoint (fleet/control_server.py)
        self._engine_nodes: list[str | None] = []  # node id of each managed engine (updated when placed again)
        self._replacements = Replacements(self)
        self._capacity = CapacityPolicy(self.rollout.min_rollout_engines, self.rollout.min_rollout_engines_timeout)

    # ------------------------------------------------------------------ start

    def start(self, store_probe=None) -> dict:
        """Start the router and the engines (or attach them); returns the URLs.

        ``store_probe`` (a :class:`~miles_disagg.weights.probe.StoreProbe` the trainer wrote):
        each managed engine's node must read it back before its engine starts, else
        ``ConfigError`` naming the nodes and the store path. A failure stops whatever was
        started (router, engine processes) before it propagates.
        """
        try:
            return self._start(store_probe)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, store_probe) -> dict:
        if self.rollout.router == "sglang":
            from miles_disagg.router.sglang_router import require_sglang_router

            require_sglang_router()
        else:
            self._start_router([])
        self.engine_urls = self._attach() if self.rollout.rollout_external else self._launch(store_probe)
        if self._actors and self.placement.node_ids:
            self._engine_nodes = [self.placement.node_ids[bundles[0]] for bundles in self.placement.layout.engines]
        if self.router is None:
            self._start_router(self.engine_urls)
        local_root = local_checkpoint_root(self.config)
        self.local_dirs = [self._local_dir(url, local_root / f"engine-{i}") for i, url in enumerate(self.engine_urls)]
        if self.rollout.rollout_external:
            self._bring_to_base()
        for url in self.engine_urls:
            self.router_client.add_worker(url)
        for url in self.engine_urls:
            self.router_client.wait_worker_version(url, 0, timeout_s=60)
        self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
        self._monitor.start()
        return {"router_url": self.router.url, "engine_urls": list(self.engine_urls),
                "delta_filters": [self._announced_filters(url) for url in self.engine_urls],
                "local_dirs": list(self.local_dirs)}

    def serve_membership(self) -> str:
        """Open the endpoint ``miles-disagg engines add|remove|list`` reach (fleet/membership.py);
        the run calls it once its ``placement.json`` is written (changes rewrite that file). Returns its URL."""
        from miles_disagg.fleet.control_server import ControlServer
        from miles_disagg.net.netbind import bind_host, resolve_host

        if self._control is None:
            self.members.record_start()
            self.members.write_placement()
            self._control = ControlServer(self.members, self.run_dir,
                                          resolve_host(bind_host(spans_nodes=self.config.spans_nodes)))
        return self._control.url

    @staticmethod
    def _announced_filters(url: str) -> list[str] | None:
        with EngineClient(url, timeout_s=10) as client:
            return client.announced_delta_filters()

    def _start_router(self, workers: list[str]) -> None:
        from miles_disagg.fleet.plan import ROUTER_RETRY_AFTER_S, router_plan
        from miles_disagg.net.netbind import bind_host, resolve_host

        log_path = self.run_dir / "logs" / "router.log"
        plan = router_plan(self.config)
        host = resolve_host(bind_host(spans_nodes=self.config.spans_nodes))  # the manager runs on the driver's node
        if plan.kind == "sglang":
            from miles_disagg.router.sglang_router import SglangRouterClient, launch_sglang_router

            self.router = launch_sglang_router(log_path=log_path, workers=workers, port=plan.port, policy=plan.policy,
                                               host=host)
            self.router_client = SglangRouterClient(self.router.url)
            return
        from miles_disagg.router.launch import launch_router

        self.router = launch_router(log_path=log_path, port=plan.port, host=host,
                                    health_check_interval_s=plan.health_check_interval_s,
                                    retry_after_s=ROUTER_RETRY_AFTER_S, extra_args=plan.extra_args)
        self.router_client = self.router.client()

    def _launch(self, store_probe) -> list[str]:
        import ray

        from miles_disagg.engines.actor import EngineProcess
        from miles_disagg.fleet.plan import engine_specs, resolve_backend

        backend, _ = resolve_backend(self.rollout.rollout_backend)
        remote_cls = ray.remote(EngineProcess)
        engines = self.placement.layout.engines
        for bundles, spec in zip(engines, engine_specs(self.config, engines, backend)):
            actor = remote_cls.options(num_cpus=0.2, num_gpus=0.2, max_concurrency=4,
                                       scheduling_strategy=self.placement.strategy(bundles[0])).remote(spec)
            self._actors.append(actor)
        self._check_paths(store_probe)
        return ray.get([a.start.remote() for a in self._actors])

    def _check_paths(self, probe) -> None:
        """Each engine's node must see the base checkpoint and (given the trainer's probe) the
        version store at their paths; ``ConfigError`` naming every node that does not."""
        import ray

        problems: dict[str, list[str]] = {}  # "node: what it lacks" -> engines
        for index, found in enumerate(ray.get([a.check_paths.remote(probe) for a in self._actors])):
            position = self.placement.layout.engines[index][0]
            node = f"node {self.placement.node_ips[position]} (id {self.placement.node_ids[position]})"
            for problem in found:
                problems.setdefault(f"{problem} on {node}", []).append(f"engine {index}")
        if problems:
            where = "; ".join(f"{problem} ({', '.join(engines)})" for problem, engines in problems.items())
            raise ConfigError(f"a rollout node lacks a shared path: {where}. The version store must be shared "
                              "storage mounted at the same path on the trainer's and every engine's node, and the "
                              "base checkpoint must be at the same path on every node",
                              ("--update-weight-disk-dir", "--hf-checkpoint"))

    def _attach(self) -> list[str]:
        urls = [f"http://{addr}" for addr in self.rollout.rollout_external_engine_addrs]
        for url in urls:
            _wait_answering(url, ATTACH_TIMEOUT_S)
            problems = self._mismatches(url)
            if problems:
                raise ConfigError(f"--rollout-external-engine-addrs {url.removeprefix('http://')} does not match this "
                                  f"job: {'; '.join(problems)}", ("--rollout-external-engine-addrs",))
        return urls

    def _mismatches(self, url: str) -> list[str]:
        """Why the engine at ``url`` cannot serve this job (architecture, tp size, context, dtype)."""
        from miles_disagg.engines.check import EngineExpectation, check_engine_matches

        expected = EngineExpectation.from_hf_checkpoint(self.model_path, self.cluster.rollout_num_gpus_per_engine,
                                                        self.rollout.engine_dtype)
        with EngineClient(url, timeout_s=10) as client:
            server_info = client.server_info()
            return check_engine_matches(expected, server_info, client.model_info()) + self._store_mismatch(server_info)

    def _store_mismatch(self, server_info: dict) -> list[str]:
        """Disk-delta: a built-in engine pulls only from its ``--weight-store-dir``s (an agent says
        nothing here and refuses a wrong store at the first pull, naming its roots)."""
        import os

        stores = server_info.get("weight_store_dirs")
        ours = self.weights.update_weight_disk_dir
        if self.weights.update_weight_transfer_mode != "disk-delta" or stores is None or not ours:
            return []
        if any(os.path.realpath(s) == os.path.realpath(ours) for s in stores):
            return []
        return [f"weight store: the engine pulls only from {stores or 'no store (no --weight-store-dir)'}, "
                f"this job publishes to {ours!r}; start it with --weight-store-dir {ours}"]

    def _bring_to_base(self) -> None:
        """Attached engines may still serve an earlier job's version: bring each to this job's
        base (version 0) before the router sees it. Broadcast mode cannot (no store): exit 2."""
        stale = {}
        for index, url in enumerate(self.engine_urls):
            with EngineClient(url, timeout_s=10) as client:
                reported = client.weight_version()
            if reported != "0":
                stale[index] = reported
        if not stale:
            return
        described = ", ".join(f"{self.engine_urls[i].removeprefix('http://')} serves weight version {v!r}"
                              for i, v in stale.items())
        if self.weights.update_weight_transfer_mode != "disk-delta":
            raise ConfigError(f"--rollout-external-engine-addrs: {described}, not this job's base (version 0), "
                              "and broadcast mode cannot reset an engine; restart it on --hf-checkpoint or use "
                              "--update-weight-transfer-mode disk-delta", ("--rollout-external-engine-addrs",))
        log.warning("%s: bringing them to this job's base (version 0)", described)
        updater = self._updater(list(stale), registered=False)
        try:
            updater.update(0)
        finally:
            updater.close()
        self.events.append({"event": "reset_to_base", "engines": list(stale), "time": time.time()})

    @staticmethod
    def _local_dir(url: str, default: Path) -> str:
        """The engine host's own local checkpoint (an agent's, or a built-in engine's
        ``--local-checkpoint-dir``), else ours: a server writes only the one it was started with."""
        with EngineClient(url, timeout_s=5) as client:
            info = client.agent_info() or client.server_info()
        return str(info.get("local_checkpoint_dir") or default)

    # ------------------------------------------------------------------ updates

    def update_weights(self, version: int) -> dict[str, float]:
        """Bring every live engine to ``version`` (already published); returns the phase timings.

        An engine that is down (its process died, or it stopped answering) is left out and
        marked down; with ``--use-fault-tolerance`` the monitor restarts it and brings it to the
        newest version before the router uses it again, without it a managed engine that went
        down fails the run here. A live engine that fails the update fails it.
        """
        with self._lock:
            self._raise_if_lost()
            report = self._update_live(version)
            self._version = version
        return report.metrics()

    def _update_live(self, version: int):
        while True:
            live = [i for i in range(len(self.engine_urls)) if self._is_live(i)]
            updater = self._updater(live)
            try:
                return updater.update(version)
            except UpdateFailed:
                if all(self._alive(i) for i in live):
                    raise  # a live engine refused: the update fails
                # an engine died during the update: it is marked down now; the rest go again
            finally:
                updater.close()

    def init_broadcast_group(self, master_addr: str, master_port: int) -> int:
        """Broadcast mode: every engine joins the trainer's weight-update group; returns its world size."""
        self._broadcast = BroadcastUpdater(self.engine_urls, pause_mode=self.rollout.pause_generation_mode,
                                           set_state=self._set_state, ranks_per_engine=self._engine_ranks(),
                                           bucket_bytes=self.weights.update_weight_buffer_size)
        self._broadcast.init_group(master_addr, master_port)
        return self._broadcast.world_size

    def release_memory(self, tags: list[str] | None = None) -> None:
        """``--colocate``: every engine releases its memory (``tags``: SGLang's; None: all)."""
        self._each_engine(lambda client: client.release_memory(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self._each_engine(lambda client: client.resume_memory(tags))

    def _each_engine(self, call) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def one(url: str) -> None:
            with EngineClient(url) as client:
                call(client)

        with ThreadPoolExecutor(max(1, len(self.engine_urls))) as pool:
            list(pool.map(one, self.engine_urls))

    def broadcast_world_size(self) -> int:
        """1 (the trainer's source rank) + every engine's ranks (its TP size, as the engine reports it)."""
        return 1 + sum(self._engine_ranks())

    def _engine_ranks(self) -> list[int]:
        from miles_disagg.engines.updater import engine_ranks

        ranks = []
        for url in self.engine_urls:
            with EngineClient(url, timeout_s=30) as client:
                ranks.append(engine_ranks(client.server_info()))
        return ranks

    def broadcast_update(self, version: int, meta: dict[str, list]) -> dict[str, float]:
        """Broadcast mode: receive ``version`` from the trainer (which broadcasts concurrently)."""
        with self._lock:
            report = self._broadcast.update(version, meta)
            self._version = version
        return report.metrics()

    def _updater(self, indices: list[int] | None = None, *, registered: bool = True) -> DiskDeltaUpdater:
        """``registered=False``: the engines are not in the router (a restore), so the updater
        does not tell the router to pause/resume routing to them."""
        indices = list(range(len(self.engine_urls))) if indices is None else indices
        return DiskDeltaUpdater([self.engine_urls[i] for i in indices],
                                store_dir=self.weights.update_weight_disk_dir,
                                local_dirs=[self.local_dirs[i] for i in indices],
                                pause_mode=self.rollout.pause_generation_mode,
                                set_state=self._set_state if registered else None)

    def _set_state(self, url: str, state: str) -> None:
        self.router_client.set_worker_state(url, state)

    def versions(self) -> list[str | None]:
        """What each engine reports (None for an engine that is down)."""
        with self._lock:  # not mid-restore: the router lists a restored engine before it leaves _down
            down = set(self._down)
        out: list[str | None] = []
        for index, url in enumerate(self.engine_urls):
            if self.members.is_removed(index):
                continue  # left the run (engines remove)
            if index in down:  # not asked: a lost node's address may only time out
                out.append(None)
                continue
            try:
                with EngineClient(url, timeout_s=10) as client:
                    out.append(None if index in down else client.weight_version())
            except MilesDisaggError:
                out.append(None)
        return out

    def weight_checksums(self, algorithm: str) -> list[dict]:
        """Each live engine's ``/weight_checksums`` (``{"url", "error"}`` for one that cannot say)."""
        results = []
        with self._lock:
            for index, url in enumerate(self.engine_urls):
                if index in self._down or self.members.is_removed(index):
                    continue
                try:
                    with EngineClient(url, timeout_s=600) as client:
                        results.append({"url": url, **client.weight_checksums(algorithm)})
                except MilesDisaggError as exc:
                    results.append({"url": url, "error": f"{type(exc).__name__}: {exc}"})
        return results

    def _raise_if_lost(self) -> None:
        lost = [e for e in self.events if e["event"] == "lost"]
        if lost:
            raise EngineUnrecoverable(f"engine {lost[0]['engine']} ({lost[0]['url']}) went down ({lost[0]['why']}) "
                                      "and --use-fault-tolerance is off, so it is not restarted")

    def info(self) -> dict:
        with self._lock:  # not mid-restore: the router lists a restored engine before its event is recorded
            return {"router_url": self.router.url if self.router else None, "engine_urls": list(self.engine_urls),
                    "version": self._version, "events": list(self.events)}

    # ------------------------------------------------------------------ faults

    def _alive(self, index: int) -> bool:
        if self._actors and self._actors[index] is not None:  # None: an attached engine of a managed run
            return index not in self._lost and bool(self._process_alive(index))
        with EngineClient(self.engine_urls[index], timeout_s=3) as client:
            return client.healthy()

    def _is_live(self, index: int) -> bool:
        """False (and the engine marked down) when it is down or just died."""
        if index in self._down or self.members.is_removed(index):
            return False
        if self._alive(index):
            return True
        self._mark_down(index)
        return False

    def _mark_down(self, index: int) -> None:
        if index in self._down:
            return  # already out (the monitor and an update may both find it gone)
        url = self.engine_urls[index]
        self._down.add(index)
        try:
            self.router_client.remove_worker(url)
        except Exception as exc:  # the router may already have dropped it
            log.info("remove_worker %s: %s", url, exc)
        self.events.append({"engine": index, "event": "down", "url": url, "time": time.time()})

    def _watch(self) -> None:
        """``--rollout-health-check-first-wait`` once, then a check of every engine each
        ``--rollout-health-check-interval``."""
        if self._stop.wait(self.rollout.rollout_health_check_first_wait):
            return
        while not self._stop.wait(self.rollout.rollout_health_check_interval):
            try:
                self._replacements.drop_lost_nodes()  # Ray says a node is gone: no health-check timeout to wait
            except Exception:  # the GCS did not answer this time: the checks below still run
                log.exception("asking Ray which nodes are alive")
            for index in range(len(self.engine_urls)):
                if self._stop.is_set():
                    return
                try:
                    self._check_engine(index)
                except Exception as exc:  # keep watching the others; record why
                    log.exception("engine %d: recovery failed", index)
                    self.events.append({"engine": index, "event": "recovery_failed", "error": str(exc)})
            self._observe_capacity()

    def _observe_capacity(self) -> None:
        self._capacity.observe(len(self.engine_urls) - len(self._down), len(self.engine_urls))

    def capacity(self) -> dict:
        """How many engines serve, and ``verdict``: the line that ends the run once fewer than
        ``--min-rollout-engines`` served for longer than its timeout (else None)."""
        self._observe_capacity()
        return self._capacity.report(self.events, set(self._down))

    def _check_engine(self, index: int) -> None:
        import ray

        if self.members.is_removed(index):
            return  # left the run (engines remove)
        managed = bool(self._actors) and self._actors[index] is not None
        if index in self._lost or self._replacements.busy(index):
            return  # gone with its actor: being placed again (fleet/replace.py)
        if index not in self._down:
            with self._lock:
                if self._passes_health_check(index):
                    return
                self._mark_down(index)
            if not managed:
                return  # an attached engine: restored once it answers again (a later check)
        if self._broadcast is not None or index in self._lost:
            return  # a broadcast group cannot take a new member; a lost actor is placed again elsewhere
        if managed and not self.rollout.use_fault_tolerance:
            if self._process_alive(index) is not None:  # its process failed (not its node: that is placed again)
                self._record_lost(index)
            return
        if managed:
            from ray.exceptions import ActorUnavailableError, RayActorError

            try:
                self.engine_urls[index] = ray.get(self._actors[index].restart.remote())
            except ActorUnavailableError:  # its node may be going: the next check (or Ray's verdict) decides
                return
            except RayActorError as exc:  # gone with its node: placed again, not restarted
                self._replacements.engine_gone(index, "actor_lost", why=f"its actor is gone: {str(exc).splitlines()[0]}")
                return
        elif not self._answers_and_matches(index):
            return
        self._restore(index)

    def _process_alive(self, index: int) -> bool | None:
        """Whether managed engine ``index``'s process runs, as its actor says; None when the actor
        does not answer (unreachable: its node may be going) or is gone (then it is placed again)."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError

        try:
            return bool(ray.get(self._actors[index].alive.remote(), timeout=self.rollout.rollout_health_check_timeout))
        except (ActorUnavailableError, GetTimeoutError):
            return None
        except RayActorError as exc:
            self._replacements.engine_gone(index, "actor_lost", why=f"its actor is gone: {str(exc).splitlines()[0]}")
            return None

    def _passes_health_check(self, index: int) -> bool:
        """A managed engine's process must be alive; every engine must answer ``/health`` within
        ``--rollout-health-check-timeout``, failing ``--rollout-health-check-failure-threshold``
        times in a row at most."""
        if self._actors and not self._alive(index):
            return False
        with EngineClient(self.engine_urls[index], timeout_s=self.rollout.rollout_health_check_timeout) as client:
            ok = client.healthy(timeout_s=self.rollout.rollout_health_check_timeout)
        self._failures[index] = 0 if ok else self._failures.get(index, 0) + 1
        return self._failures[index] < self.rollout.rollout_health_check_failure_threshold

    def _record_lost(self, index: int) -> None:
        if any(e["event"] == "lost" and e["engine"] == index for e in self.events):
            return
        why = "its process exited" if self._actors and not self._alive(index) else "it failed its health checks"
        log.error("engine %d went down (%s); --use-fault-tolerance is off: not restarting it", index, why)
        self.events.append({"engine": index, "event": "lost", "url": self.engine_urls[index], "why": why,
                            "time": time.time()})

    def _answers_and_matches(self, index: int) -> bool:
        """An attached engine that answers again is re-checked against the job before it is restored."""
        url = self.engine_urls[index]
        with EngineClient(url, timeout_s=3) as client:
            if not client.healthy():
                return False
        problems = self._mismatches(url)
        if problems:
            if not any(e["event"] == "mismatch" and e["engine"] == index for e in self.events[-5:]):
                self.events.append({"engine": index, "event": "mismatch", "url": url, "problems": problems,
                                    "time": time.time()})
            return False
        return True

    def _restore(self, index: int) -> None:
        """Bring a (re)started engine to the current version, then let the router use it."""
        with self._lock:
            if self.members.is_removed(index):
                return  # removed (engines remove) while it was down: it stays out
            version = self._version
            if version > 0:
                updater = self._updater([index], registered=False)  # added to the router only below
                try:
                    updater.update(version)
                finally:
                    updater.close()
            verify_served_version(self.engine_urls[index], index, version)
            self.router_client.add_worker(self.engine_urls[index])
            self._down.discard(index)
            self.events.append({"engine": index, "event": "restored", "url": self.engine_urls[index],
                                "version": version, "time": time.time()})

    def kill_engine(self, index: int) -> int | None:
        """Tests and drills: SIGKILL one managed engine's process; returns its pid."""
        import os
        import signal

        import ray

        pid = ray.get(self._actors[index].pid.remote())
        if pid:
            os.kill(pid, signal.SIGKILL)
        return pid

    def shutdown(self) -> None:
        import ray

        self._stop.set()
        if self._control is not None:
            self._control.stop()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=60)  # a restart in progress finishes before the engines stop
        self._replacements.stop()
        for index, actor in enumerate(self._actors):
            if index in self._lost or actor is None:
                continue  # gone with its node (and its processes with it), removed, or attached
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as exc:  # a dead actor: its process is gone already
                log.info("engine actor stop: %s", exc)
        self._actors = []
        if self.router is not None:
            self.router.stop()


def _wait_answering(url: str, timeout_s: float) -> None:
    from miles_disagg.net.process import NotHealthy, wait_healthy

    try:
        wait_healthy(url, timeout_s=timeout_s, poll_s=1.0)
    except NotHealthy as exc:
        raise ConfigError(f"--rollout-external-engine-addrs: {url} did not answer /health: {exc.reason}",
                          ("--rollout-external-engine-addrs",)) from None
