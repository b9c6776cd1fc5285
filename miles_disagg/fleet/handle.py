"""The engine manager as a run sees it: one Ray actor behind typed methods.

:class:`EngineManagerHandle` creates the :class:`~miles_disagg.fleet.manager.EngineManager`
actor and forwards to it; nothing outside this module calls ``.remote`` on it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.remote import Pending


@dataclass
class EngineUpdate:
    """What an update of every engine to one version measured, and what the engines then serve."""

    version: int
    metrics: dict[str, float] = field(default_factory=dict)
    """The phase timings (``perf/update_weights_prepare_time``, ``..._pause_time``, ...)."""
    engine_versions: list[str | None] = field(default_factory=list)
    """What each engine reports afterwards (None: down)."""


class PendingEngineUpdate:
    """Engines preparing and activating a published version while the caller goes on."""

    def __init__(self, handle: "EngineManagerHandle", version: int, pending: Pending[dict]):
        self.handle, self.version, self._pending = handle, version, pending
        self.started = time.perf_counter()

    def finish(self) -> EngineUpdate:
        """Wait until every live engine serves the version (the manager's error if one failed)."""
        metrics = dict(self._pending.result())
        metrics["perf/update_weights_time"] = time.perf_counter() - self.started
        return EngineUpdate(self.version, metrics, self.handle.versions())


class EngineManagerHandle:
    """Start the engine manager actor (``start``), update weights, stop it (``shutdown``)."""

    def __init__(self, config: EngineManagerConfig, placement: Any = None):
        """``placement``: the run's; the manager (and its router) go to its driver's node."""
        import ray

        from miles_disagg.fleet.manager import EngineManager

        from miles_disagg.net.netbind import keys_runtime_env

        strategy = placement.control_strategy() if placement is not None else None
        self._actor = (ray.remote(EngineManager)
                       .options(num_cpus=0, max_concurrency=8, scheduling_strategy=strategy, runtime_env=keys_runtime_env())
                       .remote(config, placement=placement))
        self.router_url: str | None = None
        self.engine_urls: list[str] = []
        self.delta_filters: list[list[str] | None] = []
        self.local_dirs: list[str] = []
        """Each engine's host-local checkpoint directory (a path on that engine's node)."""

    def start(self, store_probe=None) -> None:
        """Launch or attach the engines and the router (the manager cleans up if this fails);
        ``store_probe``: each engine's node must read the trainer's probe back first."""
        info = Pending([self._actor.start.remote(store_probe)]).result()
        self.router_url, self.engine_urls = info["router_url"], list(info["engine_urls"])
        self.delta_filters = list(info.get("delta_filters") or [])
        self.local_dirs = list(info["local_dirs"])

    def refresh_engine_urls(self) -> bool:
        """Read the current members' URLs again into :attr:`engine_urls` (engines join, leave and are
        placed again mid-run); True when they changed since the last read (or the start)."""
        urls = list(Pending([self._actor.member_urls.remote()]).result())
        changed, self.engine_urls = urls != self.engine_urls, urls
        return changed

    def serve_membership(self) -> str:
        """Open the membership control endpoint (``miles-disagg engines``); its URL."""
        return Pending([self._actor.serve_membership.remote()]).result()

    def weight_checksums(self, algorithm: str) -> list[dict]:
        """Each live engine's ``/weight_checksums`` (see ``EngineManager.weight_checksums``)."""
        return Pending([self._actor.weight_checksums.remote(algorithm)]).result()

    def start_update(self, version: int) -> PendingEngineUpdate:
        """Disk-delta: every engine prepares ``version`` (already published), then activates it."""
        return PendingEngineUpdate(self, version, Pending([self._actor.update_weights.remote(version)]))

    def update_weights(self, version: int) -> EngineUpdate:
        return self.start_update(version).finish()

    def versions(self) -> list[str | None]:
        return Pending([self._actor.versions.remote()]).result()

    def release_memory(self, tags: list[str] | None = None) -> None:
        """``--colocate``: every engine releases its memory (SGLang's tags; None: all)."""
        Pending([self._actor.release_memory.remote(tags)]).result()

    def resume_memory(self, tags: list[str] | None = None) -> None:
        Pending([self._actor.resume_memory.remote(tags)]).result()

    def broadcast_world_size(self) -> int:
        return Pending([self._actor.broadcast_world_size.remote()]).result()

    def init_broadcast_group(self, master_addr: str, master_port: int) -> Pending[int]:
        """Broadcast mode: the engines start joining the trainer's group (the trainer joins concurrently)."""
        return Pending([self._actor.init_broadcast_group.remote(master_addr, master_port)])

    def broadcast_update(self, version: int, meta: dict[str, list]) -> Pending[dict]:
        """Broadcast mode: the engines start receiving ``version`` (the trainer sends concurrently)."""
        return Pending([self._actor.broadcast_update.remote(version, meta)])

    def capacity(self, timeout_s: float = 10.0) -> dict:
        """The manager's capacity state (``{"live", "total", "min_engines", "below_for_s", "verdict"}``).
        A plain ``ray.get``: the run's capacity watch calls it from inside the driver's waits."""
        import ray

        return ray.get(self._actor.capacity.remote(), timeout=timeout_s)

    def events(self, timeout_s: float = 30.0) -> list[dict]:
        """What happened to the engines (down, restored, node_lost, replaced, ...), oldest first."""
        import ray

        return list(ray.get(self._actor.info.remote(), timeout=timeout_s)["events"])

    def shutdown(self, timeout_s: float = 60.0) -> None:
        Pending([self._actor.shutdown.remote()]).result(timeout_s)
