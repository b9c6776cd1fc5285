"""Pieces shared by both loops: advantages, the update step, one step's metrics record."""

from __future__ import annotations

import time
from typing import Any

from miles_disagg.config.components import RunConfig
from miles_disagg.types import Group, Sample


def assign_advantages(groups: list[Group], config: RunConfig) -> list[Sample]:
    """GRPO: each sample's reward minus its group's mean (over the group's std); samples in order."""
    import torch

    from miles_disagg.trainer.losses import grpo_advantages

    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    if config.train.advantage_estimator == "grpo":
        adv = grpo_advantages(rewards, normalize_by_std=config.train.normalize_advantages_by_std)
    else:
        adv = rewards - rewards.mean()  # reinforce_plus_plus-style global baseline
    samples = []
    for g, row in zip(groups, adv.tolist()):
        for s, a in zip(g.samples, row):
            s.advantage = float(a)
            samples.append(s)
    return samples


def publish_and_update(job, version_before: int) -> tuple[int, dict[str, Any]]:
    """Publish the trainer's policy as the next version and bring every engine to it."""
    if job.config.weights.update_weight_transfer_mode == "broadcast":
        return broadcast_update(job, version_before + 1)
    import ray

    published = job.trainer.publish()
    version = published["version"]
    if version != version_before + 1:
        raise RuntimeError(f"published version {version}, expected {version_before + 1}")
    metrics: dict[str, Any] = {
        "perf/update_weights_encode_time": published["encode_time_s"],
        "perf/update_weights_publish_time": published["publish_time_s"],
        "perf/update_weights_density": published["density"],
        "perf/update_weights_wire_bytes": published["wire_bytes"],
        "perf/update_weights_total_bytes": published["total_bytes"],
    }
    if job.manager is not None:
        start = time.perf_counter()
        metrics.update(ray.get(job.manager.update_weights.remote(version)))
        metrics["perf/update_weights_time"] = time.perf_counter() - start
        metrics["weights/engine_versions"] = ray.get(job.manager.versions.remote())
    metrics["weights/version"] = version
    return version, metrics


def step_record(train_metrics: dict, rollout_metrics: dict, update_metrics: dict, timings: dict,
                num_samples: int) -> dict[str, Any]:
    record: dict[str, Any] = {}
    record.update(rollout_metrics)
    record.update(train_metrics)
    record.update(update_metrics)
    record.update(timings)
    if timings.get("perf/step_time"):
        record["perf/samples_per_s"] = num_samples / timings["perf/step_time"]
    return record


def broadcast_update(job, version: int) -> tuple[int, dict[str, Any]]:
    """Broadcast mode: the trainer sends every tensor over the weight-update group."""
    import ray

    start = time.perf_counter()
    sending = job.trainer.broadcast_weights()
    metrics: dict[str, Any] = dict(ray.get(job.manager.broadcast_update.remote(version, job.tensor_meta)))
    ray.get(sending)
    metrics["perf/update_weights_time"] = time.perf_counter() - start
    metrics["perf/update_weights_wire_bytes"] = metrics["perf/update_weights_total_bytes"] = _nbytes(job.tensor_meta)
    metrics["perf/update_weights_density"] = 1.0  # broadcast sends every tensor whole
    metrics["weights/version"] = version
    metrics["weights/engine_versions"] = ray.get(job.manager.versions.remote())
    return version, metrics


def _nbytes(meta: dict[str, list]) -> int:
    import math

    import torch

    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(meta["dtypes"], meta["shapes"]))
