"""The one activation lifecycle: prepare -> pause -> activate -> continue -> verify.

Used by the rollout's weight updaters (:mod:`miles_disagg.engines.updater`) and by the
service replicas' reconciler (:mod:`miles_disagg.service.reconciler`), so a fix to
activation is made once.

1. :func:`prepare` (``/pull_weights``): the host materializes and verifies the version while
   the engine keeps generating. A failure raises the engine client's own typed error
   (``StagingRefused``, ``EngineUnreachable``, ...) and **nothing live has changed**: the
   engine still serves its old version and may stay in rotation.
2. :func:`activate`: pause (``mode``), flush the cache (unless ``in_place``), load the prepared
   version, then continue. ``/continue_generation`` is attempted whatever happened, so no
   engine is left paused. Then the engine must report exactly the version. **Once the pause
   has begun, any fault raises** :class:`ActivationFailed`: the engine's live weights are
   unknown and the caller must keep it out of rotation until a later activation succeeds.

The engine is anything with the port's methods (``pull``, ``pause``, ``flush``, ``load``,
``resume``, ``version``): :class:`~miles_disagg.engines.client.EngineClient`, or a fake.
"""

from __future__ import annotations

import time
from typing import Callable, Protocol

from miles_disagg.types import EngineUnrecoverable


class ActivationFailed(EngineUnrecoverable):
    """Activation failed after the pause began; the engine's live weights are unknown."""


class EnginePort(Protocol):
    def pull(self, version: int) -> object: ...
    def pause(self, mode: str) -> None: ...
    def flush(self) -> None: ...
    def load(self, version: int) -> None: ...
    def resume(self) -> None: ...
    def version(self) -> int | None: ...


def prepare(engine: EnginePort, version: int, timer: Callable[[], float] = time.perf_counter) -> float:
    """Pull ``version`` while serving; returns the seconds it took. Errors: the client's, nothing changed."""
    start = timer()
    engine.pull(version)
    return timer() - start


def activate(engine: EnginePort, version: int, *, pause_mode: str, flush: bool | None = None,
             load: Callable[[], None] | None = None, on_paused: Callable[[], None] | None = None,
             timer: Callable[[], float] = time.perf_counter) -> float:
    """Pause, load, continue, verify (see the module docstring); returns the pause in seconds.

    ``flush``: flush the cache before loading (default: unless ``pause_mode`` is ``in_place``).
    ``load``: how the version gets in (default ``engine.load(version)``; broadcast mode receives
    it over the weight-update group). ``on_paused``: called once paused; raising fails the activation.
    """
    flush = pause_mode != "in_place" if flush is None else flush
    errors: list[str] = []
    start = timer()
    try:
        engine.pause(pause_mode)
        if on_paused is not None:
            on_paused()
        if flush:
            engine.flush()
        (load or (lambda: engine.load(version)))()
    except Exception as exc:  # noqa: BLE001 - after the pause began, every fault fails the activation
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        errors += _attempt(engine.resume, "continue_generation")
    pause_s = timer() - start
    if not errors:
        errors += _check_version(engine, version)
    if errors:
        raise ActivationFailed(f"activation of v{version} failed: {'; '.join(errors)}")
    return pause_s


def _attempt(fn: Callable[[], None], what: str) -> list[str]:
    try:
        fn()
        return []
    except Exception as exc:  # noqa: BLE001 - reported as an activation failure
        return [f"{what}: {type(exc).__name__}: {exc}"]


def _check_version(engine: EnginePort, version: int) -> list[str]:
    try:
        reported = engine.version()
    except Exception as exc:  # noqa: BLE001
        return [f"model_info (weight_version): {type(exc).__name__}: {exc}"]
    return [] if reported == version else [f"the engine reports version {reported} after activating v{version}"]
