"""Thin helpers for the handle classes around Ray actors (``TrainerGroup``, the engine manager's
and the rollout manager's handles), so callers never touch Ray object refs themselves."""

from __future__ import annotations

from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class Pending(Generic[T]):
    """Calls in flight on one or more actors; :meth:`result` waits for all of them.

    ``combine`` turns the list of per-actor results into the caller's value (default: the
    first one, for calls whose ranks all return the same thing or only rank 0 returns).
    """

    def __init__(self, refs: list, combine: Callable[[list], T] | None = None):
        self._refs = list(refs)
        self._combine = combine or (lambda results: results[0] if results else None)

    def result(self, timeout_s: float | None = None) -> T:
        import ray

        return self._combine(ray.get(self._refs, timeout=timeout_s))


def call_all(actors: list, method: str, *args: Any, **kwargs: Any) -> list:
    """Call ``method`` on every actor at once and wait for all; the results in actor order."""
    import ray

    return ray.get([getattr(actor, method).remote(*args, **kwargs) for actor in actors])
