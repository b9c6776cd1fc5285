"""One step's metrics record, and the engines' busy fraction that goes into it."""

from __future__ import annotations

import time
from typing import Any


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


def open_tracker(config, *, start_step: int | None) -> "MetricsTracker":
    """The run's metrics tracker with miles' logging flags (``--use-tensorboard --tb-project-name
    --tb-experiment-name``, ``--use-wandb --wandb-*``)."""
    from miles_disagg.tracking import MetricsTracker, WandbOptions, tensorboard_dir

    tracking = config.tracking
    wandb = WandbOptions(project=tracking.wandb_project, group=tracking.wandb_group, team=tracking.wandb_team,
                         key=tracking.wandb_key, host=tracking.wandb_host, mode=tracking.wandb_mode,
                         dir=tracking.wandb_dir, run_id=tracking.wandb_run_id,
                         random_suffix=not tracking.disable_wandb_random_suffix)
    from miles_disagg.config.loader import config_to_dict

    return MetricsTracker(tracking.run_dir, use_tensorboard=tracking.use_tensorboard, use_wandb=tracking.use_wandb,
                          wandb_options=wandb, run_config=config_to_dict(config), start_step=start_step,
                          tensorboard_dir=tensorboard_dir(tracking.run_dir, tracking.tb_project_name,
                                                          tracking.tb_experiment_name))


class BusyMeter:
    """Fraction of wall time the engines had a request in flight, from the router's counters
    (None where the router does not count busy time, e.g. sglang-router)."""

    def __init__(self, router_url: str | None):
        import httpx

        self.router_url = router_url
        self._client = httpx.Client(timeout=10, trust_env=False) if router_url else None  # one per run
        self._last = self._read() if router_url else None

    def _read(self) -> tuple[float, float, int] | None:
        from miles_disagg.net.auth import ApiKeys

        workers = self._client.get(f"{self.router_url}/list_workers",
                                   headers=ApiKeys.from_env().headers_for("/list_workers")).json().get("workers")
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
