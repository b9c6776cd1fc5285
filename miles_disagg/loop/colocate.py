"""``train.py --colocate``: the trainer and the engines take turns on the same GPUs.

Per step, in this order (miles' order, with SGLang's memory tags):

1. the engines generate while the trainer's parameters and optimizer state are offloaded;
2. :func:`to_trainer`: the engines release their memory (weights, KV cache, CUDA graphs), the
   trainer onloads;
3. the trainer trains;
4. :func:`to_engines`: the trainer offloads its optimizer state (its gradients are dropped),
   the engines resume their weights, the trainer hands the new policy over by reference
   (``/update_weights_from_tensor``; the last bucket labels the engines' weights with the new
   version), the trainer offloads its parameters, the engines resume their KV cache.

No version is published to a store (``--colocate`` has none): versions count up as in
broadcast mode. A failure anywhere fails the step (the run stops naming it).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_disagg.fleet.handle import EngineManagerHandle
    from miles_disagg.trainer.group import TrainerGroup

KV_TAGS = ["kv_cache", "cuda_graph"]


def start(trainer: TrainerGroup) -> dict[str, int]:
    """At job start both sides hold their weights: the trainer steps aside for the first rollout."""
    return trainer.offload()


def to_trainer(trainer: TrainerGroup, engines: EngineManagerHandle) -> dict[str, float]:
    """The engines release their memory, the trainer onloads; the handoff's timings."""
    start_s = time.perf_counter()
    engines.release_memory(None)
    released = time.perf_counter()
    trainer.onload()
    return {"perf/colocate_engine_release_time": released - start_s,
            "perf/colocate_trainer_onload_time": time.perf_counter() - released}


def to_engines(trainer: TrainerGroup, engines: EngineManagerHandle, version: int) -> tuple[int, dict[str, Any]]:
    """Hand the trained policy to the engines as ``version``; the step's update metrics."""
    start_s = time.perf_counter()
    offloaded = trainer.offload(params=False)  # optimizer state first: the engines need the room
    engines.resume_memory(["weights"])
    pushed = trainer.push_weights(engines.engine_urls, version)
    offloaded_params = trainer.offload(optimizer=False)
    engines.resume_memory(KV_TAGS)
    return version, {
        "perf/update_weights_time": time.perf_counter() - start_s,
        "perf/update_weights_push_time": pushed.get("seconds", 0.0),
        "perf/update_weights_wire_bytes": pushed.get("bytes", 0),
        "perf/update_weights_total_bytes": pushed.get("bytes", 0),
        "perf/update_weights_density": 1.0,
        "perf/colocate_offloaded_bytes": offloaded["optimizer"] + offloaded["grads"] + offloaded_params["params"],
        "weights/version": version,
        "weights/engine_versions": engines.versions(),
    }
