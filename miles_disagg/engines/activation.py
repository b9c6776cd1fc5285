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
``resume``, ``version``): :class:`~miles_disagg.engines.client.EngineClient`, or a fake; the
``*_async`` forms also take coroutine methods (:class:`~miles_disagg.engines.async_client.AsyncEngineClient`).
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Protocol

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
    return _run_sync(prepare_async(engine, version, timer))


def activate(engine: EnginePort, version: int, *, pause_mode: str, flush: bool | None = None,
             load: Callable[[], None] | None = None, on_paused: Callable[[], None] | None = None,
             timer: Callable[[], float] = time.perf_counter) -> float:
    """Pause, load, continue, verify (see the module docstring); returns the pause in seconds.

    ``flush``: flush the cache before loading (default: unless ``pause_mode`` is ``in_place``).
    ``load``: how the version gets in (default ``engine.load(version)``; broadcast mode receives
    it over the weight-update group). ``on_paused``: called once paused; raising fails the activation.
    """
    return _run_sync(activate_async(engine, version, pause_mode=pause_mode, flush=flush, load=load,
                                    on_paused=on_paused, timer=timer))


# The lifecycle is written once, as coroutines that accept a synchronous port (its methods return
# values) or an asynchronous one (they return awaitables, e.g. AsyncEngineClient): fanning out to
# hundreds of engines from one event loop costs a fraction of a thread and an httpx client per engine.
# With a synchronous port nothing ever suspends, so prepare()/activate() drive them without a loop.


async def prepare_async(engine: EnginePort, version: int, timer: Callable[[], float] = time.perf_counter) -> float:
    """:func:`prepare` for a synchronous or an asynchronous port."""
    start = timer()
    await _call(engine.pull, version)
    return timer() - start


async def activate_async(engine: EnginePort, version: int, *, pause_mode: str, flush: bool | None = None,
                         load: Callable[[], Any] | None = None, on_paused: Callable[[], Any] | None = None,
                         timer: Callable[[], float] = time.perf_counter) -> float:
    """:func:`activate` for a synchronous or an asynchronous port (and ``load``/``on_paused``)."""
    flush = pause_mode != "in_place" if flush is None else flush
    errors: list[str] = []
    start = timer()
    try:
        await _call(engine.pause, pause_mode)
        if on_paused is not None:
            await _call(on_paused)
        if flush:
            await _call(engine.flush)
        await (_call(load) if load is not None else _call(engine.load, version))
    except Exception as exc:  # noqa: BLE001 - after the pause began, every fault fails the activation
        errors.append(f"{type(exc).__name__}: {exc}")
    finally:
        errors += await _attempt(engine.resume, "continue_generation")
    pause_s = timer() - start
    if not errors:
        errors += await _check_version(engine, version)
    if errors:
        raise ActivationFailed(f"activation of v{version} failed: {'; '.join(errors)}")
    return pause_s


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    return await result if inspect.isawaitable(result) else result


def _run_sync(coroutine: Any) -> Any:
    """Run a lifecycle coroutine over a synchronous port: it never suspends, so one step finishes it."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise TypeError("the engine port returned an awaitable: use prepare_async/activate_async in an event loop")


async def _attempt(fn: Callable[[], Any], what: str) -> list[str]:
    try:
        await _call(fn)
        return []
    except Exception as exc:  # noqa: BLE001 - reported as an activation failure
        return [f"{what}: {type(exc).__name__}: {exc}"]


async def _check_version(engine: EnginePort, version: int) -> list[str]:
    try:
        reported = await _call(engine.version)
    except Exception as exc:  # noqa: BLE001
        return [f"model_info (weight_version): {type(exc).__name__}: {exc}"]
    return [] if reported == version else [f"the engine reports version {reported} after activating v{version}"]
