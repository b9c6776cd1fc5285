"""Settings of one router process (:class:`RouterConfig`); pure, no I/O."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """Settings of one router process (the bind address is the server's, not here)."""

    workers: tuple[str, ...] = ()
    """Worker URLs registered at start; each is probed before it is routed to."""
    health_check_interval_s: float = 1.0
    """Seconds between health passes over all workers."""
    health_check_timeout_s: float = 2.0
    """Timeout of each probe request (``/health``, ``/model_info``)."""
    health_failure_threshold: int = 2
    """Probe timeouts in a row that take a worker out (refusals and error statuses: one)."""
    retry_after_s: float = 1.0
    """Advised wait sent with 409/503 answers (``Retry-After`` rounds it up to whole seconds)."""
    request_timeout_s: float = 600.0
    """Read timeout of a proxied request (generation can take long)."""
    connect_timeout_s: float = 5.0
    """Connect timeout of a proxied request (a refused connection fails at once)."""

    def __post_init__(self) -> None:
        for name in ("health_check_interval_s", "health_check_timeout_s", "request_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s!r}")
        if self.health_failure_threshold < 1:
            raise ValueError(f"health_failure_threshold must be >= 1, got {self.health_failure_threshold!r}")
