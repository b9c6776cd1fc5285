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

**One-call activation.** An engine whose ``/pull_weights`` answer announces it (``miles_disagg``:
``{"activate_weights": true}``, see :func:`offers_one_call`; the built-in engine and
``miles-disagg agent`` do) takes step 2 as one admin request, ``POST /activate_weights``
(:data:`ACTIVATE_PATH`): the engine runs this same lifecycle itself (pause, flush, load, continue,
version check) and answers with its own pause. Its pause then holds no round trip to the caller, so it
does not grow with the number of engines one caller updates at once. The failure rules are the same:
any fault of the call is :class:`ActivationFailed` (the engine continued itself whatever happened;
when it did not answer at all, the caller attempts ``/continue_generation`` too, as step 2 would).
A port opts in with ``one_call_activation = True`` and an ``activate_in_one_call(version, pause_mode,
flush)`` method returning the engine's answer; a custom ``load`` or ``on_paused`` needs the steps.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable, Protocol

from miles_disagg.types import EngineUnreachable, EngineUnrecoverable

ACTIVATE_PATH = "/activate_weights"
"""The one-call activation endpoint (an admin path) of the built-in engine and the agent."""

ONE_CALL_ANNOUNCEMENT = {"activate_weights": True}
"""What an engine puts under ``miles_disagg`` (in its ``/pull_weights`` answer and its server info)
when it takes :data:`ACTIVATE_PATH`."""


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
    if load is None and on_paused is None and getattr(engine, "one_call_activation", False) is True:
        return await _activate_in_one_call(engine, version, pause_mode, flush)
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


async def _activate_in_one_call(engine: Any, version: int, pause_mode: str, flush: bool) -> float:
    """Step 2 as one request (see the module docstring); the engine's own pause, in seconds."""
    try:
        answer = await _call(engine.activate_in_one_call, version, pause_mode, flush)
    except Exception as exc:  # noqa: BLE001 - the engine may have paused: every fault fails the activation
        errors = [f"{type(exc).__name__}: {exc}"]
        if isinstance(exc, EngineUnreachable):  # no answer: the engine may be paused still
            errors += await _attempt(engine.resume, "continue_generation")
        raise ActivationFailed(f"activation of v{version} failed: {'; '.join(errors)}") from exc
    reported = answer.get("weight_version") if isinstance(answer, dict) else None
    pause_ms = answer.get("pause_ms") if isinstance(answer, dict) else None
    if reported != str(version):
        raise ActivationFailed(f"activation of v{version} failed: the engine reports version {reported} "
                               f"after activating v{version}")
    if not isinstance(pause_ms, (int, float)) or isinstance(pause_ms, bool) or pause_ms < 0:
        raise ActivationFailed(f"activation of v{version} failed: the engine's answer has no pause_ms ({answer!r:.200})")
    return pause_ms / 1e3


def offers_one_call(pull_answer: Any) -> bool:
    """Whether a ``/pull_weights`` answer (or a server info) announces :data:`ACTIVATE_PATH`."""
    announced = pull_answer.get("miles_disagg") if isinstance(pull_answer, dict) else None
    return isinstance(announced, dict) and announced.get("activate_weights") is True


def one_call_answer(version: int, pause_s: float) -> dict:
    """The engine's answer to :data:`ACTIVATE_PATH` once :func:`activate` (over its own port, which must
    not itself take the one call) returned ``pause_s``: ``weight_version`` and ``pause_ms``."""
    return {"success": True, "weight_version": str(version), "pause_ms": round(pause_s * 1e3, 3),
            "message": f"Activated version {version} in one call (pause {pause_s * 1e3:.1f} ms)."}


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
