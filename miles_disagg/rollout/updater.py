"""Weight updaters: bring every engine to the trainer's newest version.

``DiskDeltaUpdater.update(version)`` runs the reference lifecycle after the publisher has
committed ``version``:

1. ``/pull_weights`` on every engine at once, before any pause: each host materializes
   and verifies the version while it keeps generating. One failure fails the update here,
   and no engine has been paused.
2. Per engine, in parallel: the router stops sending it requests, ``/pause_generation``
   (mode), ``/flush_cache`` unless ``in_place``, ``/update_weights_from_disk`` with
   ``weight_version``, then ``/continue_generation`` and the router routes to it again.
   ``/continue_generation`` runs whatever happened, so no engine is left paused.
3. Every engine must then report the version; otherwise the update fails.

The engine URL is the engine itself (built-in engine) or its ``miles-disagg agent``
(stock SGLang), which implements ``/pull_weights`` beside the engine.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Sequence

from miles_disagg.rollout.engine_client import EngineClient, EngineRequestFailed
from miles_disagg.types import ReplaceReplica


class UpdateFailed(ReplaceReplica):
    """An engine failed an update; the message names it and the phase."""


@dataclass
class UpdateReport:
    version: int
    prepare_time_s: float  # slowest engine's /pull_weights, overlapping generation
    pause_time_s: float  # longest time any engine could not generate
    activate_time_s: float  # whole step 2 (all engines, in parallel)
    per_engine_pause_s: list[float] = field(default_factory=list)

    def metrics(self) -> dict[str, float]:
        return {"perf/update_weights_prepare_time": self.prepare_time_s,
                "perf/update_weights_pause_time": self.pause_time_s,
                "perf/update_weights_activate_time": self.activate_time_s}


StateHook = Callable[[str, str], None]  # (engine url, "paused" | "ready")


class DiskDeltaUpdater:
    def __init__(self, engine_urls: Sequence[str], *, store_dir: str, local_dirs: Sequence[str],
                 pause_mode: str = "retract", set_state: StateHook | None = None):
        if len(local_dirs) != len(engine_urls):
            raise ValueError("one local checkpoint dir per engine")
        self.clients = [EngineClient(url) for url in engine_urls]
        self.store_dir = os.path.abspath(store_dir)
        self.local_dirs = [os.path.abspath(d) for d in local_dirs]  # not resolve(): the dir is a symlink
        self.pause_mode = pause_mode
        self.set_state = set_state or (lambda url, state: None)
        self._pool = ThreadPoolExecutor(max(1, len(self.clients)), thread_name_prefix="update")

    def update(self, version: int) -> UpdateReport:
        start = time.perf_counter()
        self._all(lambda i: self.prepare(i, version), "prepare")
        prepared = time.perf_counter()
        pauses = self._all(lambda i: self.activate(i, version), "activate")
        done = time.perf_counter()
        return UpdateReport(version, prepared - start, max(pauses, default=0.0), done - prepared, pauses)

    def prepare(self, index: int, version: int) -> None:
        self.clients[index].post("/pull_weights", {"target_version": version, "source_dir": self.store_dir,
                                                   "local_checkpoint_dir": self.local_dirs[index]})

    def activate(self, index: int, version: int) -> float:
        """Pause, load the prepared version, continue; returns the pause length (seconds)."""
        client = self.clients[index]
        self.set_state(client.url, "paused")
        paused_at = time.perf_counter()
        try:
            client.post("/pause_generation", {"mode": self.pause_mode})
            try:
                if self.pause_mode != "in_place":
                    client.post("/flush_cache")
                client.post("/update_weights_from_disk", {"model_path": self.local_dirs[index],
                                                          "weight_version": str(version)})
            finally:
                client.post("/continue_generation")
        finally:
            pause = time.perf_counter() - paused_at
            self.set_state(client.url, "ready")  # routed again by the version it really serves
        reported = client.weight_version()
        if reported != str(version):
            raise UpdateFailed(f"{client.url} reports weight_version {reported!r} after activating {version}")
        return pause

    def _all(self, fn: Callable[[int], float | None], phase: str) -> list:
        return _run_all(self._pool, self.clients, fn, phase)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self.clients:
            c.close()


class BroadcastUpdater:
    """``--update-weight-transfer-mode broadcast``: SGLang's stock torch.distributed path.

    ``init_group`` has every engine join the trainer's weight-update group (engine i at rank
    i + 1; the trainer's source rank is 0) with ``/init_weights_update_group``; the trainer
    joins concurrently. ``update`` pauses every engine, posts
    ``/update_weights_from_distributed`` to all of them at once (they receive while the
    trainer broadcasts), then continues each; ``/continue_generation`` runs whatever happened.
    """

    def __init__(self, engine_urls: Sequence[str], *, pause_mode: str = "retract", set_state: StateHook | None = None,
                 group_name: str = "miles_disagg_weight_update"):
        self.clients = [EngineClient(url) for url in engine_urls]
        self.pause_mode, self.group_name = pause_mode, group_name
        self.set_state = set_state or (lambda url, state: None)
        self._pool = ThreadPoolExecutor(max(1, len(self.clients)), thread_name_prefix="broadcast")

    @property
    def world_size(self) -> int:
        return len(self.clients) + 1

    def init_group(self, master_addr: str, master_port: int) -> None:
        def join(i: int) -> None:
            self.clients[i].post("/init_weights_update_group", {
                "master_address": master_addr, "master_port": master_port, "rank_offset": i + 1,
                "world_size": self.world_size, "group_name": self.group_name, "backend": "nccl"})
        _run_all(self._pool, self.clients, join, "init_weights_update_group")

    def update(self, version: int, meta: dict[str, list]) -> UpdateReport:
        start = time.perf_counter()
        for client in self.clients:
            self.set_state(client.url, "paused")
        _run_all(self._pool, self.clients, lambda i: self.clients[i].post("/pause_generation", {"mode": self.pause_mode}),
                 "pause_generation")
        try:
            body = {**meta, "group_name": self.group_name, "weight_version": str(version),
                    "flush_cache": self.pause_mode != "in_place"}
            _run_all(self._pool, self.clients,
                     lambda i: self.clients[i].post("/update_weights_from_distributed", body), "update")
        finally:
            for client in self.clients:
                client.post("/continue_generation")
                self.set_state(client.url, "ready")
        pause = time.perf_counter() - start
        for client in self.clients:
            if client.weight_version() != str(version):
                raise UpdateFailed(f"{client.url} does not report version {version} after the broadcast")
        return UpdateReport(version, 0.0, pause, pause, [pause] * len(self.clients))


def _run_all(pool: ThreadPoolExecutor, clients: Sequence[EngineClient], fn: Callable[[int], object], phase: str) -> list:
    futures = [pool.submit(fn, i) for i in range(len(clients))]
    results, errors = [], []
    for client, future in zip(clients, futures):
        try:
            results.append(future.result())
        except EngineRequestFailed as exc:
            errors.append(f"{phase} on {client.url}: {exc}")
    if errors:
        raise UpdateFailed("; ".join(errors))
    return results
