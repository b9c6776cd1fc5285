"""One step's metrics record, and the engines' busy fraction that goes into it."""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)


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


READ_TIMEOUT_S = 10.0
"""One read of the router's counters (a slow router makes a reading skipped, never a failed run)."""


class BusyMeter:
    """Fraction of wall time the engines had a request in flight, from the router's counters
    (None where the router does not count busy time, e.g. sglang-router).

    A metrics read never ends a run: a read that fails (the router slow to answer under load, gone
    for a moment, or answering something unexpected) is logged and gives no reading; the next
    reading covers the time since the last good one."""

    def __init__(self, router_url: str | None, timeout_s: float = READ_TIMEOUT_S):
        import httpx

        self.router_url = router_url
        self._client = httpx.Client(timeout=timeout_s, trust_env=False) if router_url else None  # one per run
        self._last = self._read() if router_url else None

    def _read(self) -> tuple[float, float, int] | None:
        """(time, total busy seconds, number of workers); None when the router gave no reading."""
        try:
            return self._busy_counters()
        except Exception as exc:  # noqa: BLE001 - a metric must never end the run
            log.warning("engine busy fraction: no reading from %s/list_workers this time (%s: %s)",
                        self.router_url, type(exc).__name__, exc)
            return None

    def _busy_counters(self) -> tuple[float, float, int] | None:
        from miles_disagg.net.auth import ApiKeys

        response = self._client.get(f"{self.router_url}/list_workers",
                                    headers=ApiKeys.from_env().headers_for("/list_workers"))
        response.raise_for_status()
        workers = response.json().get("workers")
        if not workers or not all("busy_s" in w for w in workers):
            return None
        return time.monotonic(), float(sum(w["busy_s"] for w in workers)), len(workers)

    def fraction(self) -> float | None:
        """Busy fraction since the previous good reading (None: no reading now, or none before)."""
        if self._client is None:
            return None
        now = self._read()
        if now is None:
            return None
        if self._last is None:  # the first good reading: the next call measures from here
            self._last = now
            return None
        (t0, busy0, _), (t1, busy1, n) = self._last, now
        self._last = now
        return min(1.0, max(0.0, (busy1 - busy0) / ((t1 - t0) * n))) if t1 > t0 else None
