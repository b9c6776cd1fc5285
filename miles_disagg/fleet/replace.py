"""Managed engines whose node (or actor) is gone: placed again when the cluster allows.

When a node leaves the Ray cluster, Ray's GCS reschedules the placement-group bundles that were
on it as soon as some node offers their resources (a node coming back, or a new node with the
rollout resource), keeping the other bundles where they are. An engine of such a bundle is
started again by a new :class:`~miles_disagg.engines.actor.EngineProcess` actor asked for the
same bundle: its creation waits (in a thread of its own, never holding the engine set's lock)
until Ray has placed the bundle. The new engine starts from the base checkpoint, is caught up
from the version store (base + chain: :meth:`~miles_disagg.fleet.routing.EngineRouting.restore`),
its version is read back and only then is it registered with the router.

:func:`dead_nodes` is how the engine manager learns that a node is gone without waiting for
health-check timeouts: Ray already says so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.fleet.routing import EngineRouting
from miles_disagg.fleet.slots import EngineSlots

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0
"""Pause before another attempt when a replacement failed to start (its new node went too, ...)."""
MAX_ATTEMPTS = 20


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Those of ``node_ids`` that Ray's GCS does not list as alive."""
    import ray

    if not node_ids:
        return set()
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return set(node_ids) - alive


class Replacements:
    """One thread per managed engine being placed again; the monitor asks :meth:`busy` before it
    touches such an engine itself. ``stopping`` is set when the engine manager shuts down."""

    def __init__(self, config: EngineManagerConfig, placement: Any, slots: EngineSlots, routing: EngineRouting,
                 stopping: threading.Event):
        self.config, self.placement = config, placement
        self.slots, self.routing, self.stopping = slots, routing, stopping
        self._threads: dict[int, threading.Thread] = {}
        self._pending: dict[int, Any] = {}  # index -> the actor being created (killed on stop)
        self._guard = threading.Lock()
        self.on_moved: Callable[[int, dict | None], None] = lambda index, site: None
        """Called with an engine's index and its new site once it was placed again (its new address
        is in ``slots``): the engine manager records it (``placement.json``)."""

    # ------------------------------------------------------------------ losses

    def drop_lost_nodes(self) -> None:
        """Every managed engine on a node Ray no longer lists as alive leaves the router now."""
        slots = self.slots
        nodes = {slots.node(i) for i in slots.indices() if slots.node(i) and not slots.is_lost(i)}
        if not nodes:
            return
        dead = self._dead(nodes)
        for index in slots.indices():
            node = slots.node(index)
            if node in dead and not slots.is_lost(index):
                self.engine_gone(index, "node_lost", why=f"its node (id {node}) left the Ray cluster", node_id=node)

    def _dead(self, nodes: set[str]) -> set[str]:
        return dead_nodes(nodes)

    def engine_gone(self, index: int, event: str, why: str, node_id: str | None = None) -> None:
        """Engine ``index`` lost its actor (``event``: ``node_lost`` or ``actor_lost``): out of the
        router at once (its in-flight requests fail there and are retried elsewhere), recorded,
        and placed again."""
        slots = self.slots
        if slots.is_lost(index):
            return
        node = node_id or slots.node(index)
        if event == "actor_lost" and node and self._dead({node}):  # name the cause when Ray knows it
            event, why = "node_lost", f"its node (id {node}) left the Ray cluster"
        slots.mark_lost(index)
        self.routing.take_out(index)
        url = slots.url(index)
        log.warning("engine %d (%s): %s; placing it again when the cluster allows", index, url, why)
        slots.record({"engine": index, "event": event, "url": url, "why": why, "node_id": node, "time": time.time()})
        self.start(index)

    def busy(self, index: int) -> bool:
        with self._guard:
            thread = self._threads.get(index)
            return thread is not None and thread.is_alive()

    def start(self, index: int) -> None:
        """Place engine ``index`` again (no-op while a replacement of it runs, or in broadcast
        mode, whose group cannot take a new member)."""
        if self.slots.broadcast_group or not self.slots.has_actors:
            return
        if self.placement is None or index >= len(self.placement.layout.engines):
            return  # joined mid-run (`engines add --managed`): its own placement group went with it; it stays out
        with self._guard:
            running = self._threads.get(index)
            if running is not None and running.is_alive():
                return
            thread = threading.Thread(target=self._run, args=(index,), name=f"replace-engine-{index}", daemon=True)
            self._threads[index] = thread
        thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """The manager is shutting down (``stopping`` is set): kill actors still being created."""
        import ray

        with self._guard:
            pending, threads = list(self._pending.values()), list(self._threads.values())
        for actor in pending:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.info("replacement actor kill: %s", exc)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=timeout_s)

    # ------------------------------------------------------------------ one replacement

    def _run(self, index: int) -> None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            if self.stopping.is_set():
                return
            try:
                placed = self._place(index)
            except Exception as exc:  # the new actor died or could not start: try again later
                log.warning("engine %d: replacement attempt %d failed: %s", index, attempt, exc)
                self.slots.record({"engine": index, "event": "replace_failed", "attempt": attempt,
                                   "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                   "time": time.time()})
                if self.stopping.wait(RETRY_AFTER_S):
                    return
                continue
            if placed is None:
                return  # stopped while waiting for the cluster
            try:
                self._adopt(index, *placed)
            except Exception as exc:
                log.exception("engine %d: restoring the replacement failed", index)
                self.slots.record({"engine": index, "event": "recovery_failed", "error": str(exc), "time": time.time()})
            return

    def _place(self, index: int):
        """A new actor on the engine's bundle, started; None when the manager stopped first."""
        import ray

        try:
            ray.kill(self.slots.actor(index), no_restart=True)  # gone with its node, or broken: never two on one bundle
        except Exception as exc:
            log.info("engine %d: old actor kill: %s", index, exc)
        actor = self._new_actor(index)
        with self._guard:
            self._pending[index] = actor
        try:
            problems = self._wait(actor.check_paths.remote(None))  # waits for Ray to place the bundle
            if problems is None:
                return None
            if problems:
                raise RuntimeError("; ".join(problems))
            url = self._wait(actor.start.remote())
            site = self._wait(actor.site.remote())
            if url is None or site is None:
                return None
            return actor, url, site
        except BaseException:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
            raise
        finally:
            with self._guard:
                self._pending.pop(index, None)

    def _wait(self, ref):
        """``ray.get(ref)`` that gives up (None) when the manager stops."""
        import ray

        while not self.stopping.is_set():
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                return ray.get(ref)
        return None

    def _new_actor(self, index: int):
        """An ``EngineProcess`` actor for engine ``index`` on its bundle (as the manager's launch makes them)."""
        from miles_disagg.engines.actor import create_engine_actor
        from miles_disagg.fleet.plan import launch_specs

        engines = self.placement.layout.engines
        return create_engine_actor(launch_specs(self.config, engines)[index], self.placement.strategy(engines[index][0]))

    def _adopt(self, index: int, actor, url: str, site: dict) -> None:
        """The placed engine takes index ``index``'s place; caught up and verified, then routed to."""
        from miles_disagg.fleet.attach import engine_local_dir
        from miles_disagg.fleet.plan import local_checkpoint_root

        with self.slots.lock:
            local_dir = engine_local_dir(url, local_checkpoint_root(self.config) / f"engine-{index}")
            self.slots.replace(index, actor=actor, url=url, node=site["node_id"], local_dir=local_dir)
            self.slots.record({"engine": index, "event": "replaced", "url": url, **site, "time": time.time()})
        self.on_moved(index, site)
        self.routing.restore(index)
