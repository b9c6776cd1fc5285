"""One managed engine, owned by a Ray actor placed in the engine's first GPU bundle.

The actor only knows where it runs (the node's address, if the job spans nodes and the engine
must bind it; the GPUs Ray gave its bundle) and
hands the rest to :func:`miles_disagg.engines.launch.start_engine`: the built-in engine, or
SGLang behind ``miles-disagg agent``. Either way it returns one URL that speaks the engine
API plus ``/pull_weights``.
"""

from __future__ import annotations

import dataclasses
import os

from miles_disagg.engines.launch import EngineSpec, RunningEngine, start_engine


class EngineProcess:
    """Ray actor body: start, stop, restart and probe one engine. ``spec.host`` and
    ``spec.base_gpu_id`` are filled in on the node the actor was placed on."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self._running: RunningEngine | None = None

    def start(self) -> str:
        self._running = start_engine(self._placed_spec())
        return self._running.url

    def _placed_spec(self) -> EngineSpec:
        import ray

        from miles_disagg.netbind import resolve_host

        gpu_ids = ray.get_gpu_ids()
        # SGLang picks its GPUs by --base-gpu-id, so it sees the node's devices, not the actor's one
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        return dataclasses.replace(self.spec, host=resolve_host(self.spec.host),
                                   base_gpu_id=int(gpu_ids[0]) if gpu_ids else 0, sglang_env=env)

    def alive(self) -> bool:
        return self._running is not None and self._running.alive()

    def pid(self) -> int | None:
        return self._running.pid() if self._running is not None else None

    def stop(self) -> None:
        if self._running is not None:
            self._running.stop()
        self._running = None

    def restart(self) -> str:
        self.stop()
        return self.start()
