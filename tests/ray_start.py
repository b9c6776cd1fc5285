"""Ray started by the tests survives a busy machine.

Three measures, for every Ray the test processes start (``ray.init`` in a test process, and
``ray start`` of ``tests/e2e/cluster_fixtures.py``):

1. Ray's own startup deadlines, scaled by the machine's measured load (``deadlines.LOAD_FACTOR``):
   :data:`RAY_STARTUP_DEFAULTS` times the factor go into the test processes' environment, so every Ray they start
   (and every whole run's local Ray) inherits them. Health checks are not scaled: how fast a lost
   node is noticed is itself under test.
2. One Ray start at a time on the machine (:func:`start_retrying`): the test processes (pytest-xdist
   workers) and the whole runs they launch take turns (an ``flock`` the runs' own local Ray start
   takes too, ``miles_disagg/loop/ray_start.py``). A start is a burst of several processes importing
   Ray's agents; two bursts on two cores starve each other past Ray's fixed 30 s wait for its node
   to register ("The current node timed out during startup").
3. A node start that timed out anyway is stopped and tried again, as a run's own local Ray start
   is (:func:`start_retrying`: the same code).

Whole runs start their local Ray inside ``train_async.py``, which takes the same turn, retries a
timed-out start itself and inherits the scaled deadlines.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, TypeVar

from deadlines import LOAD_FACTOR, scaled

T = TypeVar("T")

# Ray's defaults (ray_constants.py and ray_config_def.h of Ray 2.x) of the deadlines a start meets
RAY_STARTUP_DEFAULTS = {
    "RAY_gcs_server_request_timeout_seconds": 60,  # the driver's and the CLI's requests to the GCS
    "RAY_gcs_rpc_server_reconnect_timeout_s": 60,  # a raylet or worker waiting for the GCS
    "RAY_worker_register_timeout_seconds": 60,  # a started worker process registering with its raylet
}


def ray_startup_timeouts(factor: float = LOAD_FACTOR) -> dict[str, str]:
    """Ray's startup deadlines times ``factor`` (never below Ray's own defaults)."""
    return {name: str(int(default * max(1.0, factor))) for name, default in RAY_STARTUP_DEFAULTS.items()}


RAY_WORKER_NICENESS = {"RAY_worker_niceness": "0"}
"""The Rays the tests start themselves (``ray.init`` in a test, ``ray start``) run their workers at the
tests' niceness, as a run's own local Ray does (``LOCAL_RAY_SYSTEM_CONFIG``): at Ray's default 15,
any other process on a busy machine takes the cores from them."""


def export_ray_test_environment() -> None:
    """Put the scaled deadlines (and the workers' niceness) into this process's environment (what the
    user set stays)."""
    for name, value in {**ray_startup_timeouts(), **RAY_WORKER_NICENESS}.items():
        os.environ.setdefault(name, value)


def start_retrying(start: Callable[[], T], clean_up: Callable[[], None], what: str) -> T:
    """``start()`` as a run's own local Ray start goes (``start_with_retries``: a start turn, and
    ``clean_up()`` then another try when the node timed out during startup), the turn waited for at
    most a scaled 300 s."""
    from miles_disagg.loop.ray_start import START_TURN_WAIT_S, start_with_retries

    return start_with_retries(start, clean_up, what, scaled(START_TURN_WAIT_S))


def guard_ray_init() -> None:
    """Make this process's ``ray.init`` take a start turn and retry a start that timed out (after
    stopping what the failed start left). Idempotent."""
    import ray

    real_init = ray.init
    if getattr(real_init, "_miles_disagg_guarded", False):
        return

    def init(*args, **kwargs):
        address = args[0] if args else kwargs.get("address", os.environ.get("RAY_ADDRESS"))
        if ray.is_initialized() or address not in (None, "", "local"):
            return real_init(*args, **kwargs)  # connecting to a running cluster: nothing is started
        return start_retrying(lambda: real_init(*args, **kwargs), _stop_failed_start, "ray.init")

    init._miles_disagg_guarded = True  # type: ignore[attr-defined]
    init.__wrapped__ = real_init  # type: ignore[attr-defined]
    init.__doc__ = real_init.__doc__
    ray.init = init


def _stop_failed_start() -> None:
    """Stop what a failed ``ray.init`` left: ``ray.shutdown()``, then this process's children that
    run Ray's own programs (the GCS, the raylet, its agents)."""
    import ray

    from miles_disagg.loop.ray_start import stop_ray_children

    with contextlib.suppress(Exception):
        ray.shutdown()
    stop_ray_children()
