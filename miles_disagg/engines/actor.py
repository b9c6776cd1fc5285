"""One managed engine, owned by a Ray actor placed in the engine's first GPU bundle.

The actor only knows where it runs (the node's address, if the job spans nodes and the engine
must bind it: :func:`miles_disagg.net.netbind.bind_host` decides; the GPUs Ray gave its bundle) and
hands the rest to :func:`miles_disagg.engines.launch.start_engine`: the built-in engine, or
SGLang behind ``miles-disagg agent``. Either way it returns one URL that speaks the engine
API plus ``/pull_weights``.

Everything host-local lives on the actor's node: the actor creates the engine's local
checkpoint directory there (the path is read on this node, never on the driver's), and
:meth:`EngineProcess.check_paths` looks for the shared paths (base checkpoint, version store)
on this node before the engine starts.
"""

from __future__ import annotations

import dataclasses
import os

from miles_disagg.engines.launch import EngineSpec, RunningEngine, start_engine

ACTOR_NUM_CPUS = 0.2
ACTOR_NUM_GPUS = 0.2
"""A share of its bundle's GPU: enough for Ray to give the actor that GPU's id (``ray.get_gpu_ids()``)
and schedule it into the bundle, leaving the GPU itself to the engine process the actor starts."""
ACTOR_MAX_CONCURRENCY = 4
"""Probes (``alive``, ``pid``, ``site``) answer while a ``start`` or ``restart`` runs."""


def create_engine_actor(spec: EngineSpec, scheduling_strategy):
    """The one way an engine's actor is made: an :class:`EngineProcess` for ``spec``, scheduled by
    ``scheduling_strategy`` (the engine's first GPU bundle). Returns the actor handle at once; Ray
    creates it once the bundle is placed, and nothing is started until ``start`` is called."""
    import ray

    return ray.remote(EngineProcess).options(num_cpus=ACTOR_NUM_CPUS, num_gpus=ACTOR_NUM_GPUS,
                                             max_concurrency=ACTOR_MAX_CONCURRENCY,
                                             scheduling_strategy=scheduling_strategy).remote(spec)


class EngineProcess:
    """Ray actor body: start, stop, restart and probe one engine. ``spec.base_gpu_id`` is
    filled in on the node the actor was placed on."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self._running: RunningEngine | None = None

    def start(self) -> str:
        self.spec.local_checkpoint_dir.mkdir(parents=True, exist_ok=True)
        self._running = start_engine(self._placed_spec())
        return self._running.url

    def check_paths(self, probe=None) -> list[str]:
        """What this node lacks of the shared paths: the base checkpoint (``--hf-checkpoint``) and,
        given the trainer's store probe, the version store (``--update-weight-disk-dir``)."""
        from miles_disagg.weights.probe import read_probe

        problems = []
        if not self.spec.base_from_store and not (self.spec.model_path / "config.json").is_file():
            problems.append(f"--hf-checkpoint {str(self.spec.model_path)!r}: no checkpoint there (no config.json)")
        found = read_probe(probe) if probe is not None else None
        if found is not None:
            problems.append(f"--update-weight-disk-dir {probe.store_dir!r}: {found}")
        return problems

    def _placed_spec(self) -> EngineSpec:
        import ray

        from miles_disagg.engines.sglang import sglang_device_view
        from miles_disagg.net.netbind import resolve_host

        # SGLang picks its GPUs by --base-gpu-id, so it sees the node's devices (as restricted
        # there), not only the actor's one
        base_gpu_id, visible = sglang_device_view(ray.get_gpu_ids(), _node_visible_gpus(), self.spec.tp_size)
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        return dataclasses.replace(self.spec, host=resolve_host(self.spec.host), base_gpu_id=base_gpu_id,
                                   sglang_env=env)

    def alive(self) -> bool:
        return self._running is not None and self._running.alive()

    def site(self) -> dict:
        """Where this actor runs: node id, node IP and the GPU ids of its bundle."""
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def pid(self) -> int | None:
        return self._running.pid() if self._running is not None else None

    def stop(self) -> None:
        if self._running is not None:
            self._running.stop()
        self._running = None

    def restart(self) -> str:
        self.stop()
        return self.start()


def _node_visible_gpus() -> list[str] | None:
    """The node's CUDA_VISIBLE_DEVICES as this Ray worker found it before Ray narrowed it to the
    actor's GPUs (None: unset). Ray records it on the worker and maps its GPU ids through it."""
    from ray._private.worker import global_worker

    original = getattr(global_worker, "original_visible_accelerator_ids", None)
    if original is None:
        raise RuntimeError("this Ray version does not record the node's visible GPUs "
                           "(ray._private.worker.global_worker.original_visible_accelerator_ids)")
    ids = original.get("GPU")
    return None if ids is None else [str(i) for i in ids]
