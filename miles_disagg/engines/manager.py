"""The engine manager (a Ray actor): launches or attaches engines, runs the router, updates
weights, and replaces failed engines.

Managed: one ``EngineProcess`` actor per engine group of bundles (built-in engine, or SGLang
behind ``miles-disagg agent``). Attached (``--rollout-external``): nothing is launched; each
address must answer and match the job (architecture, tp size, context length, dtype), else
``ConfigError`` naming the field and both values. Either way every engine is registered with
the version-aware router that this actor starts.

Faults: a monitor thread watches the engines. A managed engine whose process died is taken
out of the router at once, restarted, brought to the current version (base + chain through
``/pull_weights``) and only then registered again. An attached engine that stops answering
is removed; when it answers again it is re-checked and brought to the current version
before it is registered again. Weight updates and restores never interleave (one lock).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.updater import BroadcastUpdater, DiskDeltaUpdater, UpdateFailed
from miles_disagg.types import ConfigError, MilesDisaggError

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 120.0
MONITOR_INTERVAL_S = 1.0


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
        self._broadcast: BroadcastUpdater | None = None

    # ------------------------------------------------------------------ start

    def start(self) -> dict:
        """Start the router and the engines (or attach them); returns the URLs.

        A failure stops whatever was started (router, engine processes) before it propagates.
        """
        try:
            return self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> dict:
        if self.rollout.router == "sglang":
            from miles_disagg.router.sglang_router import require_sglang_router

            require_sglang_router()
        else:
            self._start_router([])
        self.engine_urls = self._attach() if self.rollout.rollout_external else self._launch()
        if self.router is None:
            self._start_router(self.engine_urls)
        local_root = Path(self.weights.update_weight_local_checkpoint_dir or self.run_dir / "rollout-checkpoints")
        self.local_dirs = [self._local_dir(url, local_root / f"engine-{i}") for i, url in enumerate(self.engine_urls)]
        if self.rollout.rollout_external:
            self._bring_to_base()
        for url in self.engine_urls:
            self.router_client.add_worker(url)
        for url in self.engine_urls:
            self.router_client.wait_worker_version(url, 0, timeout_s=60)
        self._monitor = threading.Thread(target=self._watch, name="engine-monitor", daemon=True)
        self._monitor.start()
        return {"router_url": self.router.url, "engine_urls": list(self.engine_urls)}

    def _start_router(self, workers: list[str]) -> None:
        log_path = self.run_dir / "logs" / "router.log"
        if self.rollout.router == "sglang":
            from miles_disagg.router.sglang_router import SglangRouterClient, launch_sglang_router

            self.router = launch_sglang_router(log_path=log_path, workers=workers)
            self.router_client = SglangRouterClient(self.router.url)
            return
        from miles_disagg.router.launch import launch_router

        self.router = launch_router(log_path=log_path, health_check_interval_s=self.rollout.rollout_health_check_interval,
                                    retry_after_s=0.2)
        self.router_client = self.router.client()

    def _launch(self) -> list[str]:
        import ray

        from miles_disagg.engines.actor import EngineProcess
        from miles_disagg.engines.launch import EngineSpec

        backend = _resolve_backend(self.rollout.rollout_backend)
        sglang_args = dict(self.sglang_args)
        if self.cluster.colocate and backend == "sglang":
            sglang_args.setdefault("enable-memory-saver", True)  # what /release_memory_occupation needs on GPU
        remote_cls = ray.remote(EngineProcess)
        local_root = Path(self.weights.update_weight_local_checkpoint_dir or self.run_dir / "rollout-checkpoints")
        for index, bundles in enumerate(self.placement.layout.engines):
            spec = EngineSpec(backend=backend, name=f"engine-{index}", model_path=Path(self.model_path),
                              log_dir=self.run_dir / "logs", local_checkpoint_dir=local_root / f"engine-{index}",
                              tp_size=len(bundles), dtype=self.rollout.engine_dtype, seed=self.seed + index,
                              max_running_requests=64,
                              pre_read_hook=self.weights.sglang_custom_pull_weights_pre_read_hook,
                              sglang_args=sglang_args)
            actor = remote_cls.options(num_cpus=0.2, num_gpus=0.2, max_concurrency=4,
                                       scheduling_strategy=self.placement.strategy(bundles[0])).remote(spec)
            self._actors.append(actor)
        return ray.get([a.start.remote() for a in self._actors])

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
            return check_engine_matches(expected, client.server_info(), client.model_info())

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
        """An agent owns its local checkpoint dir (ask it); a built-in engine takes ours."""
        with EngineClient(url, timeout_s=5) as client:
            info = client.agent_info()
        return str(info.get("local_checkpoint_dir") or default) if info else str(default)

    # ------------------------------------------------------------------ updates

    def update_weights(self, version: int) -> dict[str, float]:
        """Bring every live engine to ``version`` (already published); returns the phase timings.

        An engine that is down (its process died, or it stopped answering) is left out and
        marked down; the monitor restarts it and brings it to the newest version before the
        router uses it again. A live engine that fails the update fails it.
        """
        with self._lock:
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
                                           set_state=self._set_state, ranks_per_engine=self._engine_ranks())
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
        out: list[str | None] = []
        for index, url in enumerate(self.engine_urls):
            try:
                with EngineClient(url, timeout_s=10) as client:
                    out.append(None if index in self._down else client.weight_version())
            except MilesDisaggError:
                out.append(None)
        return out

    def info(self) -> dict:
        return {"router_url": self.router.url if self.router else None, "engine_urls": list(self.engine_urls),
                "version": self._version, "events": list(self.events)}

    # ------------------------------------------------------------------ faults

    def _alive(self, index: int) -> bool:
        import ray

        if self._actors:
            return bool(ray.get(self._actors[index].alive.remote()))
        with EngineClient(self.engine_urls[index], timeout_s=3) as client:
            return client.healthy()

    def _is_live(self, index: int) -> bool:
        """False (and the engine marked down) when it is down or just died."""
        if index in self._down:
            return False
        if self._alive(index):
            return True
        self._mark_down(index)
        return False

    def _mark_down(self, index: int) -> None:
        url = self.engine_urls[index]
        self._down.add(index)
        try:
            self.router_client.remove_worker(url)
        except Exception as exc:  # the router may already have dropped it
            log.info("remove_worker %s: %s", url, exc)
        self.events.append({"engine": index, "event": "down", "url": url, "time": time.time()})

    def _watch(self) -> None:
        while not self._stop.wait(MONITOR_INTERVAL_S):
            for index in range(len(self.engine_urls)):
                if self._stop.is_set():
                    return
                try:
                    self._check_engine(index)
                except Exception as exc:  # keep watching the others; record why
                    log.exception("engine %d: recovery failed", index)
                    self.events.append({"engine": index, "event": "recovery_failed", "error": str(exc)})

    def _check_engine(self, index: int) -> None:
        import ray

        managed = bool(self._actors)
        if index not in self._down:
            with self._lock:
                if self._is_live(index):  # (marks the engine down when it is not)
                    return
            if not managed:
                return  # an attached engine: restored once it answers again (a later check)
        if self._broadcast is not None:
            return  # a broadcast group cannot take a new member: the engine stays out (the run reports it)
        if managed:
            self.engine_urls[index] = ray.get(self._actors[index].restart.remote())
        elif not self._answers_and_matches(index):
            return
        self._restore(index)

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
            version = self._version
            if version > 0:
                updater = self._updater([index], registered=False)  # added to the router only below
                try:
                    updater.update(version)
                finally:
                    updater.close()
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
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=60)  # a restart in progress finishes before the engines stop
        for actor in self._actors:
            try:
                ray.get(actor.stop.remote(), timeout=60)
            except Exception as exc:  # a dead actor: its process is gone already
                log.info("engine actor stop: %s", exc)
        self._actors = []
        if self.router is not None:
            self.router.stop()


def _resolve_backend(choice: str) -> str:
    if choice != "auto":
        return choice
    import torch

    return "sglang" if torch.cuda.is_available() else "builtin"


def _wait_answering(url: str, timeout_s: float) -> None:
    from miles_disagg.process import NotHealthy, wait_healthy

    try:
        wait_healthy(url, timeout_s=timeout_s, poll_s=1.0)
    except NotHealthy as exc:
        raise ConfigError(f"--rollout-external-engine-addrs: {url} did not answer /health: {exc.reason}",
                          ("--rollout-external-engine-addrs",)) from None
