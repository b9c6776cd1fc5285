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

The engine set's state (each engine's URL, actor, node, local directory, down/lost/removed,
and the version the set serves) is one :class:`~miles_disagg.fleet.slots.EngineSlots`, shared
with the manager's parts: the router and the engines' places in it
(:mod:`miles_disagg.fleet.routing`), the monitor (:mod:`miles_disagg.fleet.monitor`), the
replacements (:mod:`miles_disagg.fleet.replace`) and membership changes
(:mod:`miles_disagg.fleet.membership`).

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
from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.updater import BroadcastUpdater, DiskDeltaUpdater, RouterCallsFailed, UpdateFailed
from miles_disagg.fleet.attach import announced_filters, attached_engines, bring_to_base, engine_local_dir
from miles_disagg.fleet.membership import Membership
from miles_disagg.fleet.monitor import EngineMonitor
from miles_disagg.fleet.plan import local_checkpoint_root
from miles_disagg.fleet.replace import Replacements
from miles_disagg.fleet.routing import EngineRouting
from miles_disagg.fleet.slots import EngineSlots
from miles_disagg.types import ConfigError, EngineUnrecoverable, MilesDisaggError

MAX_ROUTER_RETRIES = 2
"""How many times an update whose router calls alone failed is made again."""
DEATH_GRACE_S = 3.0
"""How long a failed update waits for an engine to be seen dead before it calls the failure a live
engine's refusal: a killed process closes its sockets (the request fails) a moment before it exits."""

log = logging.getLogger(__name__)


class EngineManager:
    replacements_class = Replacements
    """What places lost engines again (a test may put a subclass here)."""

    def __init__(self, config: EngineManagerConfig, placement=None):
        self.config = config
        self.cluster, self.rollout, self.weights = config.cluster, config.rollout, config.weights
        self.model_path, self.run_dir, self.seed = config.model_path, Path(config.run_dir), config.seed
        self.placement = placement
        self.sglang_args = dict(config.sglang_args)
        self.slots = EngineSlots()
        self.stopping = threading.Event()
        self.routing = EngineRouting(config, self.slots, self._updater, self.stopping)
        self.replacements = self.replacements_class(config, placement, self.slots, self.routing, self.stopping)
        self.monitor = EngineMonitor(config, self.slots, self.routing, self.replacements, self.stopping)
        self.members = Membership(config, self.slots, self.routing, placement)  # engines add/remove mid-run
        self.monitor.on_moved = self.replacements.on_moved = self.members.engine_moved  # placement.json follows
        self._broadcast: BroadcastUpdater | None = None
        self._control = None  # the membership control endpoint (fleet/control_server.py)

    @property
    def engine_urls(self) -> list[str]:
        """Every engine's URL by index (a copy; removed engines included)."""
        return self.slots.urls()

    def member_urls(self) -> list[str]:
        """The current members' URLs in index order: joins, removals and re-placements included
        (what miles' post-write hooks get as ``rollout_engines``)."""
        return [self.slots.url(i) for i in self.slots.members()]

    @property
    def local_dirs(self) -> list[str]:
        """Each engine's host-local checkpoint directory (a path on that engine's node; a copy)."""
        return self.slots.local_dirs()

    @property
    def events(self) -> list[dict]:
        return self.slots.events

    @property
    def router(self):
        return self.routing.router

    @property
    def router_client(self):
        return self.routing.client

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
            self.routing.start([])
        if self.rollout.rollout_external:
            for engine in attached_engines(self.config):
                self.slots.add(engine.url, local_dir="", server_ids=engine.server_ids)  # its local dir: asked below
        else:
            self._launch(store_probe)
        urls = self.engine_urls
        if self.router is None:
            self.routing.start(urls)
        local_root = local_checkpoint_root(self.config)
        for index, url in enumerate(urls):
            self.slots.set_local_dir(index, engine_local_dir(url, local_root / f"engine-{index}"))
        if self.rollout.rollout_external:
            bring_to_base(self.config, self.slots, self._updater)
        for url in urls:
            self.router_client.add_worker(url)
        for url in urls:
            self.router_client.wait_worker_version(url, 0, timeout_s=60)
        self.monitor.start()
        return {"router_url": self.router.url, "engine_urls": list(urls),
                "delta_filters": [announced_filters(url) for url in urls], "local_dirs": self.local_dirs}

    def _placed_node(self, index: int) -> str | None:
        """The node id the run's placement put managed engine ``index`` on (None: not known)."""
        node_ids = self.placement.node_ids
        return node_ids[self.placement.layout.engines[index][0]] if node_ids else None

    def serve_membership(self) -> str:
        """Open the endpoint ``miles-disagg engines add|remove|list`` reach (fleet/membership.py);
        the run calls it once its ``placement.json`` is written (changes rewrite that file). Returns its URL."""
        from miles_disagg.fleet.control_server import ControlServer
        from miles_disagg.net.netbind import bind_host, resolve_host

        if self._control is None:
            self.members.record_start()
            self._control = ControlServer(self.members, self.run_dir,
                                          resolve_host(bind_host(spans_nodes=self.config.spans_nodes)))
        return self._control.url

    def _launch(self, store_probe) -> None:
        """One started engine per engine of the placement, each in its slot (its local directory
        asked later); a failure before they are in their slots stops the actors made here."""
        import ray

        from miles_disagg.engines.actor import create_engine_actor
        from miles_disagg.fleet.plan import launch_specs

        engines = self.placement.layout.engines
        actors = [create_engine_actor(spec, self.placement.strategy(bundles[0]))
                  for bundles, spec in zip(engines, launch_specs(self.config, engines))]
        try:
            self._check_paths(actors, store_probe)
            urls = ray.get([a.start.remote() for a in actors])
        except BaseException:
            for actor in actors:
                _stop_actor(actor)
            raise
        for index, (actor, url) in enumerate(zip(actors, urls)):
            self.slots.add(url, local_dir="", actor=actor, node=self._placed_node(index))

    def _check_paths(self, actors: list[Any], probe) -> None:
        """Each engine's node must see the base checkpoint and (given the trainer's probe) the
        version store at their paths; ``ConfigError`` naming every node that does not."""
        import ray

        problems: dict[str, list[str]] = {}  # "node: what it lacks" -> engines
        for index, found in enumerate(ray.get([a.check_paths.remote(probe) for a in actors])):
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

    # ------------------------------------------------------------------ updates

    def update_weights(self, version: int) -> dict[str, float]:
        """Bring every live engine to ``version`` (already published); returns the phase timings.

        An engine that is down (its process died, or it stopped answering) is left out and
        marked down; with ``--use-fault-tolerance`` the monitor restarts it and brings it to the
        newest version before the router uses it again, without it a managed engine that went
        down fails the run here. A live engine that fails the update fails it.
        """
        with self.slots.lock:
            self._raise_if_lost()
            report = self._update_live(version)
            self.slots.version = version
        return {**report.metrics(), **self.routing.keeper.metrics()}

    def _update_live(self, version: int):
        """The update over the live engines; made again (over those not at ``version`` yet) when an
        engine died meanwhile, or when only router calls failed (:data:`MAX_ROUTER_RETRIES` times: the
        keeper restarted the router by then), so an update is never left half applied."""
        router_failures = 0
        while True:
            live = [i for i in self.slots.indices() if self.monitor.is_live(i)]
            if router_failures:
                live = self._route_those_at(version, live)
            updater = self._updater(live)
            try:
                return updater.update(version)
            except RouterCallsFailed as exc:
                router_failures += 1
                if router_failures > MAX_ROUTER_RETRIES:
                    raise
                log.warning("update to v%d: router calls failed (%s); made again", version, exc)
            except UpdateFailed:
                if not self._one_died(live):
                    raise  # a live engine refused: the update fails
                # an engine died during the update: it is marked down now; the rest go again
            finally:
                updater.close()

    def _route_those_at(self, version: int, indices: list[int]) -> list[int]:
        """Of ``indices``, those not serving ``version`` yet; the others are marked ready in the router
        (their activation went through, telling the router did not)."""
        rest = []
        for index in indices:
            url = self.slots.url(index)
            try:
                with EngineClient(url, timeout_s=10) as client:
                    serves = client.weight_version() == str(version)
            except MilesDisaggError:
                serves = False
            if serves:
                self.router_client.set_worker_state(url, "ready")
            else:
                rest.append(index)
        return rest

    def _one_died(self, indices: list[int]) -> bool:
        """Whether one of the engines ``indices`` died, waiting up to :data:`DEATH_GRACE_S` for its
        process to be seen gone."""
        deadline = time.monotonic() + DEATH_GRACE_S
        while all(self.monitor.alive(i) for i in indices):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return True

    def init_broadcast_group(self, master_addr: str, master_port: int) -> int:
        """Broadcast mode: every engine joins the trainer's weight-update group; returns its world size."""
        self._broadcast = BroadcastUpdater(self.engine_urls, pause_mode=self.rollout.pause_generation_mode,
                                           set_state=self._set_state, ranks_per_engine=self._engine_ranks(),
                                           bucket_bytes=self.weights.update_weight_buffer_size)
        self.slots.broadcast_group = True
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

        urls = self.engine_urls
        with ThreadPoolExecutor(max(1, len(urls))) as pool:
            list(pool.map(one, urls))

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
        with self.slots.lock:
            report = self._broadcast.update(version, meta)
            self.slots.version = version
        return report.metrics()

    def _updater(self, indices: list[int] | None = None, *, registered: bool = True) -> DiskDeltaUpdater:
        """``registered=False``: the engines are not in the router (a restore), so the updater
        does not tell the router to pause/resume routing to them."""
        indices = list(self.slots.indices()) if indices is None else indices
        return DiskDeltaUpdater([self.slots.url(i) for i in indices],
                                store_dir=self.weights.update_weight_disk_dir,
                                local_dirs=[self.slots.local_dir(i) for i in indices],
                                pause_mode=self.rollout.pause_generation_mode,
                                set_state=self._set_state if registered else None)

    def _set_state(self, url: str, state: str) -> None:
        self.router_client.set_worker_state(url, state)

    # ------------------------------------------------------------------ views

    def versions(self) -> list[str | None]:
        """What each engine reports (None for an engine that is down)."""
        with self.slots.lock:  # not mid-restore: the router lists a restored engine before it leaves down
            down = self.slots.down()
        out: list[str | None] = []
        for index, url in enumerate(self.engine_urls):
            if self.slots.is_removed(index):
                continue  # left the run (engines remove)
            if index in down:  # not asked: a lost node's address may only time out
                out.append(None)
                continue
            try:
                with EngineClient(url, timeout_s=10) as client:
                    out.append(client.weight_version())
            except MilesDisaggError:
                out.append(None)
        return out

    def weight_checksums(self, algorithm: str) -> list[dict]:
        """Each live engine's ``/weight_checksums`` (``{"url", "error"}`` for one that cannot say)."""
        results = []
        with self.slots.lock:
            for index, url in enumerate(self.engine_urls):
                if self.slots.is_down(index) or self.slots.is_removed(index):
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
        with self.slots.lock:  # not mid-restore: the router lists a restored engine before its event is recorded
            return {"router_url": self.router.url if self.router else None, "engine_urls": self.engine_urls,
                    "version": self.slots.version, "events": list(self.events)}

    def capacity(self) -> dict:
        """How many engines serve, and ``verdict``: the line that ends the run once fewer than
        ``--min-rollout-engines`` served for longer than its timeout (else None)."""
        return self.monitor.capacity()

    # ------------------------------------------------------------------ stop

    def kill_engine(self, index: int) -> int | None:
        """Tests and drills: SIGKILL one managed engine's process; returns its pid."""
        import os
        import signal

        import ray

        pid = ray.get(self.slots.actor(index).pid.remote())
        if pid:
            os.kill(pid, signal.SIGKILL)
        return pid

    def shutdown(self) -> None:
        self.stopping.set()
        if self._control is not None:
            self._control.stop()
        self.monitor.join(timeout_s=60)  # a restart in progress finishes before the engines stop
        self.replacements.stop()
        for index in self.slots.indices():
            if self.slots.is_lost(index) or self.slots.actor(index) is None:
                continue  # gone with its node (and its processes with it), removed, or attached
            _stop_actor(self.slots.actor(index))
        self.slots.clear_actors()
        self.routing.stop()


def _stop_actor(actor: Any) -> None:
    import ray

    try:
        ray.get(actor.stop.remote(), timeout=60)
    except Exception as exc:  # a dead actor: its process is gone already
        log.info("engine actor stop: %s", exc)
