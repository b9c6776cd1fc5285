"""Managed engines whose node (or actor) is gone: placed again when the cluster allows.

When a node leaves the Ray cluster, Ray's GCS reschedules the placement-group bundles that were
on it as soon as some node offers their resources (a node coming back, or a new node with the
rollout resource), keeping the other bundles where they are. An engine of such a bundle is
started again by a new :class:`~miles_disagg.engines.actor.EngineProcess` actor asked for the
same bundle: its creation waits (in a thread of its own, never holding the manager's lock)
until Ray has placed the bundle. The new engine starts from the base checkpoint, is caught up
from the version store (base + chain, :meth:`EngineManager._restore`), its version is read back
and only then is it registered with the router.

:func:`dead_nodes` is how the engine manager learns that a node is gone without waiting for
health-check timeouts: Ray already says so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_disagg.fleet.manager import EngineManager

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5.0
"""Pause before another attempt when a replacement failed to start (its new node went too, ...)."""
MAX_ATTEMPTS = 20


def verify_served_version(url: str, index: int, version: int) -> None:
    """The engine itself must report ``version`` before the router may use it (after a restart's
    or a replacement's catch-up): ``EngineUnrecoverable`` otherwise, and it stays out."""
    from miles_disagg.engines.client import EngineClient
    from miles_disagg.types import EngineUnrecoverable

    with EngineClient(url, timeout_s=30) as client:
        served = client.weight_version()
    if str(served) != str(version):
        raise EngineUnrecoverable(f"engine {index} ({url}) reports version {served!r} after its catch-up to version "
                                  f"{version}; it stays out of the router")


def dead_nodes(node_ids: set[str]) -> set[str]:
    """Those of ``node_ids`` that Ray's GCS does not list as alive."""
    import ray

    if not node_ids:
        return set()
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    return set(node_ids) - alive


class Replacements:
    """One thread per managed engine being placed again; the manager asks :meth:`busy` before
    it touches such an engine itself."""

    def __init__(self, manager: "EngineManager"):
        self.manager = manager
        self._threads: dict[int, threading.Thread] = {}
        self._pending: dict[int, Any] = {}  # index -> the actor being created (killed on stop)
        self._guard = threading.Lock()

    # ------------------------------------------------------------------ losses

    def drop_lost_nodes(self) -> None:
        """Every managed engine on a node Ray no longer lists as alive leaves the router now."""
        manager = self.manager
        nodes = {n for i, n in enumerate(manager._engine_nodes) if n and i not in manager._lost}
        if not nodes:
            return
        dead = self._dead(nodes)
        for index, node in enumerate(manager._engine_nodes):
            if node in dead and index not in manager._lost:
                self.engine_gone(index, "node_lost", why=f"its node (id {node}) left the Ray cluster", node_id=node)

    def _dead(self, nodes: set[str]) -> set[str]:
        return dead_nodes(nodes)

    def engine_gone(self, index: int, event: str, why: str, node_id: str | None = None) -> None:
        """Engine ``index`` lost its actor (``event``: ``node_lost`` or ``actor_lost``): out of the
        router at once (its in-flight requests fail there and are retried elsewhere), recorded,
        and placed again."""
        manager = self.manager
        if index in manager._lost:
            return
        node = node_id or (manager._engine_nodes[index] if index < len(manager._engine_nodes) else None)
        if event == "actor_lost" and node and self._dead({node}):  # name the cause when Ray knows it
            event, why = "node_lost", f"its node (id {node}) left the Ray cluster"
        manager._lost.add(index)
        if index not in manager._down:
            manager._mark_down(index)
        log.warning("engine %d (%s): %s; placing it again when the cluster allows", index,
                    manager.engine_urls[index], why)
        manager.events.append({"engine": index, "event": event, "url": manager.engine_urls[index], "why": why,
                               "node_id": node, "time": time.time()})
        self.start(index)

    def busy(self, index: int) -> bool:
        with self._guard:
            thread = self._threads.get(index)
            return thread is not None and thread.is_alive()

    def start(self, index: int) -> None:
        """Place engine ``index`` again (no-op while a replacement of it runs, or in broadcast
        mode, whose group cannot take a new member)."""
        manager = self.manager
        if manager._broadcast is not None or not manager._actors:
            return
        if manager.placement is None or index >= len(manager.placement.layout.engines):
            return  # joined mid-run (`engines add --managed`): its own placement group went with it; it stays out
        with self._guard:
            running = self._threads.get(index)
            if running is not None and running.is_alive():
                return
            thread = threading.Thread(target=self._run, args=(index,), name=f"replace-engine-{index}", daemon=True)
            self._threads[index] = thread
        thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """The manager is shutting down (its stop event is set): kill actors still being created."""
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
        manager = self.manager
        for attempt in range(1, MAX_ATTEMPTS + 1):
            if manager._stop.is_set():
                return
            try:
                placed = self._place(index)
            except Exception as exc:  # the new actor died or could not start: try again later
                log.warning("engine %d: replacement attempt %d failed: %s", index, attempt, exc)
                manager.events.append({"engine": index, "event": "replace_failed", "attempt": attempt,
                                       "error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                                       "time": time.time()})
                if manager._stop.wait(RETRY_AFTER_S):
                    return
                continue
            if placed is None:
                return  # stopped while waiting for the cluster
            try:
                self._adopt(index, *placed)
            except Exception as exc:
                log.exception("engine %d: restoring the replacement failed", index)
                manager.events.append({"engine": index, "event": "recovery_failed", "error": str(exc),
                                       "time": time.time()})
            return

    def _place(self, index: int):
        """A new actor on the engine's bundle, started; None when the manager stopped first."""
        import ray

        manager = self.manager
        old = manager._actors[index]
        try:
            ray.kill(old, no_restart=True)  # gone already with its node, or a broken actor: never two on one bundle
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

        while not self.manager._stop.is_set():
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                return ray.get(ref)
        return None

    def _new_actor(self, index: int):
        """An ``EngineProcess`` actor for engine ``index`` on its bundle (as the manager's launch makes them)."""
        import ray

        from miles_disagg.engines.actor import EngineProcess
        from miles_disagg.fleet.plan import engine_specs, resolve_backend

        manager = self.manager
        backend, _ = resolve_backend(manager.rollout.rollout_backend)
        engines = manager.placement.layout.engines
        spec = engine_specs(manager.config, engines, backend)[index]
        return ray.remote(EngineProcess).options(num_cpus=0.2, num_gpus=0.2, max_concurrency=4,
                                                 scheduling_strategy=manager.placement.strategy(engines[index][0])
                                                 ).remote(spec)

    def _adopt(self, index: int, actor, url: str, site: dict) -> None:
        """The placed engine takes index ``index``'s place; caught up and verified, then routed to."""
        from miles_disagg.fleet.plan import local_checkpoint_root

        manager = self.manager
        with manager._lock:
            manager._actors[index] = actor
            manager.engine_urls[index] = url
            manager._engine_nodes[index] = site["node_id"]
            manager.local_dirs[index] = manager._local_dir(url, local_checkpoint_root(manager.config) / f"engine-{index}")
            manager._failures[index] = 0
            manager._lost.discard(index)
            manager.events.append({"engine": index, "event": "replaced", "url": url, **site, "time": time.time()})
        manager._restore(index)
