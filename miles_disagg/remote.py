"""Thin helpers for the handle classes around Ray actors (``TrainerGroup``, the engine manager's
and the rollout manager's handles), so callers never touch Ray object refs themselves.

Every wait goes through :func:`wait_for`, which also runs the *watches* a run registers
(:func:`add_watch`): a watch raises when the run cannot go on (a node it placed work on left
the cluster), and the wait ends with that error instead of blocking on calls that will never
finish or failing with a bare "actor died".
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")

WATCH_INTERVAL_S = 1.0
ACTOR_DEATH_GRACE_S = 60.0
"""After an actor died, how long the watches get to name the cause (a node is declared dead
only after its health checks fail) before the actor's own error is raised."""

_watches: list[Callable[[], None]] = []


def add_watch(watch: Callable[[], None]) -> None:
    """Run ``watch`` while waiting on any call (it raises to end the waits with its error)."""
    _watches.append(watch)


def remove_watch(watch: Callable[[], None]) -> None:
    if watch in _watches:
        _watches.remove(watch)


def run_watches() -> None:
    for watch in list(_watches):
        watch()


def wait_for(refs: list, timeout_s: float | None = None) -> list:
    """``ray.get(refs, timeout=timeout_s)``, running the watches every ``WATCH_INTERVAL_S``.

    A call that fails because an actor died (directly, or inside the called actor) first gives
    the watches up to ``ACTOR_DEATH_GRACE_S`` to raise the reason; only then is its own error
    raised. Without watches this is exactly ``ray.get``."""
    import ray

    if not _watches:
        return ray.get(refs, timeout=timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = list(refs)
    while pending:
        wait_s = WATCH_INTERVAL_S if deadline is None else max(0.0, min(WATCH_INTERVAL_S, deadline - time.monotonic()))
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=wait_s)
        run_watches()
        if pending and deadline is not None and time.monotonic() >= deadline:
            break  # ray.get below raises GetTimeoutError
    try:
        return ray.get(refs, timeout=0 if pending else None)
    except Exception as exc:
        if is_actor_death(exc):
            _give_watches_time()
        raise


def is_actor_death(exc: BaseException) -> bool:
    """Whether ``exc`` (what ``ray.get`` raised) says an actor died: the called one
    (``RayActorError``), or one the called task itself was waiting on (a ``RayTaskError`` caused by it)."""
    from ray.exceptions import RayActorError, RayTaskError

    cause = exc.cause if isinstance(exc, RayTaskError) else exc
    return isinstance(exc, RayActorError) or isinstance(cause, RayActorError)


def _give_watches_time() -> None:
    deadline = time.monotonic() + ACTOR_DEATH_GRACE_S
    while time.monotonic() < deadline:
        run_watches()
        time.sleep(WATCH_INTERVAL_S)


class Pending(Generic[T]):
    """Calls in flight on one or more actors; :meth:`result` waits for all of them.

    ``combine`` turns the list of per-actor results into the caller's value (default: the
    first one, for calls whose ranks all return the same thing or only rank 0 returns).
    """

    def __init__(self, refs: list, combine: Callable[[list], T] | None = None):
        self._refs = list(refs)
        self._combine = combine or (lambda results: results[0] if results else None)

    def result(self, timeout_s: float | None = None) -> T:
        return self._combine(wait_for(self._refs, timeout_s))


def call_all(actors: list, method: str, *args: Any, **kwargs: Any) -> list:
    """Call ``method`` on every actor at once and wait for all; the results in actor order."""
    return wait_for([getattr(actor, method).remote(*args, **kwargs) for actor in actors])
