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
    version, metrics = publish(job, version_before)
    metrics.update(start_update(job, version).finish())
    return version, metrics


def publish(job, version_before: int) -> tuple[int, dict[str, Any]]:
    """The trainer commits its policy as version ``version_before + 1`` (disk-delta)."""
    published = job.trainer.publish()
    version = published["version"]
    if version != version_before + 1:
        raise RuntimeError(f"published version {version}, expected {version_before + 1}")
    return version, {
        "perf/update_weights_encode_time": published["encode_time_s"],
        "perf/update_weights_publish_time": published["publish_time_s"],
        "perf/update_weights_density": published["density"],
        "perf/update_weights_wire_bytes": published["wire_bytes"],
        "perf/update_weights_total_bytes": published["total_bytes"],
        "weights/version": version,
    }


class PendingUpdate:
    """Engines preparing and activating a published version while the trainer goes on."""

    def __init__(self, job, version: int):
        self.job, self.version = job, version
        self.started = time.perf_counter()
        self.ref = job.manager.update_weights.remote(version) if job.manager is not None else None
        if job.config.rollout.rollout_service_url:
            wake_service(job.config.rollout.rollout_service_url)

    def finish(self) -> dict[str, Any]:
        """Wait for every engine to serve the version; its timings and the engines' versions.
        (Service topology: nothing to wait for; the replicas converge on their own.)"""
        import ray

        if self.ref is None:
            return {}
        metrics: dict[str, Any] = dict(ray.get(self.ref))
        metrics["perf/update_weights_time"] = time.perf_counter() - self.started
        metrics["weights/engine_versions"] = ray.get(self.job.manager.versions.remote())
        return metrics


def start_update(job, version: int) -> PendingUpdate:
    return PendingUpdate(job, version)


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


class BusyMeter:
    """Fraction of wall time the engines had a request in flight, from the router's counters
    (None where the router does not count busy time, e.g. sglang-router)."""

    def __init__(self, router_url: str | None):
        self.router_url = router_url
        self._last = self._read() if router_url else None

    def _read(self) -> tuple[float, float, int] | None:
        import httpx

        workers = httpx.get(f"{self.router_url}/list_workers", timeout=10).json().get("workers")
        if not workers or not all("busy_s" in w for w in workers):
            return None
        return time.monotonic(), sum(w["busy_s"] for w in workers), len(workers)

    def fraction(self) -> float | None:
        """Busy fraction since the previous call."""
        if self._last is None:
            return None
        now = self._read()
        if now is None:
            return None
        (t0, busy0, _), (t1, busy1, n) = self._last, now
        self._last = now
        return min(1.0, max(0.0, (busy1 - busy0) / ((t1 - t0) * n))) if t1 > t0 else None


def wake_service(url: str) -> None:
    """Tell the service a version was published (best effort: replicas also poll the store)."""
    import httpx

    try:
        httpx.post(f"{url.rstrip('/')}/wake", timeout=5, trust_env=False)
    except httpx.HTTPError:
        pass
