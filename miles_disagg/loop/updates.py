"""The update step shared by both loops: the trainer publishes its policy as the next version,
and every engine is brought to it (disk-delta or broadcast; in the service topology the
replicas converge on their own and the service is only woken)."""

from __future__ import annotations

import time
from typing import Any

from miles_disagg.loop.ci_gates import check_weights_equal
from miles_disagg.loop.job import Job


def publish(job: Job, version_before: int) -> tuple[int, dict[str, Any]]:
    """The trainer commits its policy as version ``version_before + 1`` (disk-delta). Its post-write
    hook gets the engines that are members now (joined, left or placed again since the last step)."""
    if job.engines is not None and job.engines.refresh_engine_urls():
        job.trainer.set_rollout_engines(job.engines.engine_urls)
    published = job.trainer.publish()
    version = published.ref.version
    if version != version_before + 1:
        raise RuntimeError(f"published version {version}, expected {version_before + 1}")
    return version, published.metrics()


class PendingUpdate:
    """Engines preparing and activating a published version while the trainer goes on."""

    def __init__(self, job: Job, version: int):
        self.version = version
        self._job = job
        self._engines = job.engines.start_update(version) if job.engines is not None else None
        if job.config.rollout.rollout_service_url:
            wake_service(job.config.rollout.rollout_service_url)

    def finish(self) -> dict[str, Any]:
        """Wait for every engine to serve the version; its timings and the engines' versions.
        (Service topology: nothing to wait for; the replicas converge on their own.)"""
        if self._engines is None:
            return {}
        update = self._engines.finish()
        metrics = {**update.metrics, "weights/engine_versions": update.engine_versions}
        if self._job.config.ci.check_weight_update_equal:
            metrics.update(check_weights_equal(self._job, self.version))
        return metrics


def start_update(job: Job, version: int) -> PendingUpdate:
    return PendingUpdate(job, version)


def publish_and_update(job: Job, version_before: int) -> tuple[int, dict[str, Any]]:
    """Publish the trainer's policy as the next version and bring every engine to it."""
    if job.config.cluster.colocate:
        from miles_disagg.loop.colocate import to_engines

        return to_engines(job.trainer, job.engines, version_before + 1)
    if job.config.weights.update_weight_transfer_mode == "broadcast":
        return broadcast_update(job, version_before + 1)
    version, metrics = publish(job, version_before)
    metrics.update(start_update(job, version).finish())
    return version, metrics


def broadcast_update(job: Job, version: int) -> tuple[int, dict[str, Any]]:
    """Broadcast mode: the trainer sends every tensor over the weight-update group."""
    start = time.perf_counter()
    sending = job.trainer.broadcast_weights()
    receiving = job.engines.broadcast_update(version, job.tensor_meta)
    metrics: dict[str, Any] = dict(receiving.result())
    sending.result()
    metrics["perf/update_weights_time"] = time.perf_counter() - start
    metrics["perf/update_weights_wire_bytes"] = metrics["perf/update_weights_total_bytes"] = _nbytes(job.tensor_meta)
    metrics["perf/update_weights_density"] = 1.0  # broadcast sends every tensor whole
    metrics["weights/version"] = version
    metrics["weights/engine_versions"] = job.engines.versions()
    if job.config.ci.check_weight_update_equal:
        metrics.update(check_weights_equal(job, version))
    return version, metrics


def _nbytes(meta: dict[str, list]) -> int:
    import math

    import torch

    return sum(math.prod(shape) * getattr(torch, dtype).itemsize for dtype, shape in zip(meta["dtypes"], meta["shapes"]))


def wake_service(url: str) -> None:
    """Tell the service a version was published (best effort: replicas also poll the store)."""
    import httpx

    from miles_disagg.net.auth import ApiKeys

    try:  # /wake needs the service's admin key (--rollout-admin-api-key); without it replicas poll
        httpx.post(f"{url.rstrip('/')}/wake", timeout=5, trust_env=False, headers=ApiKeys.from_env().headers_for("/wake"))
    except httpx.HTTPError:
        pass
