"""Autoscaling from the gateway's load. Pure: no I/O; the clock is passed in.

The signal is demand at the gateway: requests in flight on replicas plus requests
turned away since the last decision because no replica was ready at all (503). Version
refusals (409) are not capacity demand: a new replica would not have the version either.

:func:`desired_replicas` is the policy: enough replicas for ``target_in_flight_per_replica``
each, within ``[min_replicas, max_replicas]``; inside a ``tolerance`` band around the target
the current count is kept (no flapping on noise). :class:`Autoscaler` adds time: scaling up
happens at once, scaling down only after the smaller count was wanted for
``scale_down_delay_s`` without interruption, and by ``max_scale_down_step`` at most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Bounds and targets of the replica count."""

    min_replicas: int = 1
    """Never fewer (also with no load)."""
    max_replicas: int = 4
    """Never more."""
    target_in_flight_per_replica: float = 8.0
    """Requests in flight per replica the pool is sized for."""
    tolerance: float = 0.1
    """Relative deviation from the target that does not change the count."""
    scale_down_delay_s: float = 30.0
    """How long a smaller count must be wanted before replicas are removed."""
    max_scale_down_step: int = 1
    """Most replicas removed by one decision."""

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= min_replicas <= max_replicas and max_replicas >= 1, "
                             f"got {self.min_replicas}, {self.max_replicas}")
        if not self.target_in_flight_per_replica > 0:
            raise ValueError(f"target_in_flight_per_replica must be > 0, got {self.target_in_flight_per_replica}")
        if not 0 <= self.tolerance < 1:
            raise ValueError(f"tolerance must be in [0, 1), got {self.tolerance}")
        if self.scale_down_delay_s < 0 or self.max_scale_down_step < 1:
            raise ValueError("scale_down_delay_s must be >= 0 and max_scale_down_step >= 1")


@dataclass(frozen=True)
class LoadSnapshot:
    """What the gateway reports (``/service_metrics`` ``load``), reduced to the policy's inputs."""

    in_flight: int
    unserved: int = 0  # requests refused for lack of any ready replica since the last decision

    @property
    def demand(self) -> int:
        return self.in_flight + self.unserved


def desired_replicas(load: LoadSnapshot, current: int, config: ScalingConfig) -> int:
    """The replica count for ``load`` given ``current`` replicas (see the module docstring)."""
    wanted = math.ceil(load.demand / config.target_in_flight_per_replica)
    if current > 0 and load.unserved == 0:
        ratio = load.demand / (current * config.target_in_flight_per_replica)
        if abs(ratio - 1.0) <= config.tolerance:
            wanted = current
    if load.unserved > 0:
        wanted = max(wanted, current + 1)  # someone found nothing ready: more capacity is needed now
    return max(config.min_replicas, min(config.max_replicas, wanted))


class Autoscaler:
    """Turns :func:`desired_replicas` into decisions over time (one caller, one thread)."""

    def __init__(self, config: ScalingConfig):
        self.config = config
        self._down_since: float | None = None
        self._last_unserved: int | None = None

    def decide(self, in_flight: int, unserved_total: int, current: int, now: float) -> int:
        """The replica count to have now. ``unserved_total`` is the gateway's running count of
        requests refused for lack of capacity (its change since the last call is the signal)."""
        unserved = 0 if self._last_unserved is None else max(0, unserved_total - self._last_unserved)
        self._last_unserved = unserved_total
        wanted = desired_replicas(LoadSnapshot(in_flight, unserved), current, self.config)
        if wanted >= current:
            self._down_since = None
            return wanted
        if self._down_since is None:
            self._down_since = now
        if now - self._down_since < self.config.scale_down_delay_s:
            return current
        self._down_since = now  # the next step down waits a full delay again
        return max(wanted, current - self.config.max_scale_down_step)
