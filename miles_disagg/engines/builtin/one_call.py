"""One-call activation (``POST /activate_weights``): the body, and the built-in engine's side of it.

The engine runs :mod:`miles_disagg.engines.activation`'s lifecycle over itself: pause, flush, load the
prepared version, continue, check the served version, with what ``/pause_generation``,
``/flush_cache``, ``/update_weights_from_disk``, ``/continue_generation`` and ``/model_info`` do,
called directly instead of over HTTP. So the failure rules and the records (the engine's log line
and ``pause_ms`` of the load, the weights path, the staged and live versions) are the per-step
sequence's, and the pause holds no round trip to the caller. ``miles-disagg agent`` takes the same
body (:mod:`miles_disagg.engines.agent.app`). Imports nothing heavy: the agent reads the body here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_disagg.engines.activation import activate, one_call_answer
from miles_disagg.engines.builtin.bodies import Body, PathStr, VersionString
from miles_disagg.engines.builtin.control_bodies import PauseMode, UpdateFromDisk
from miles_disagg.types import InvalidInput

if TYPE_CHECKING:
    from miles_disagg.engines.builtin.runtime import Engine


class ActivateWeights(Body):
    """``POST /activate_weights``: activate the version ``/pull_weights`` prepared, in one request."""

    weight_version: VersionString  # the prepared version (a decimal version number)
    model_path: PathStr | None = None  # the local checkpoint (None: the server's own)
    pause_mode: PauseMode = "retract"
    flush_cache: bool | None = None  # None: flush unless pause_mode is in_place

    def version_number(self) -> int:
        """``weight_version`` as an int; ``InvalidInput`` unless it is a decimal version number."""
        if not (self.weight_version.isascii() and self.weight_version.isdigit()):
            raise InvalidInput(f"weight_version must be a decimal version number, got {self.weight_version!r}")
        return int(self.weight_version)


class EngineItself:
    """The activation port over one built-in :class:`~miles_disagg.engines.builtin.runtime.Engine`:
    each step calls what the step's endpoint calls (``pull`` is not a step of an activation)."""

    one_call_activation = False  # this port *is* the one call's steps

    def __init__(self, engine: Engine, model_path: str):
        self.engine, self.model_path = engine, model_path
        self.load_answer: dict | None = None

    def pull(self, version: int) -> object:
        raise NotImplementedError("an activation does not pull")

    def pause(self, mode: str) -> None:
        self.engine.pause(mode)

    def flush(self) -> None:
        if not self.engine.flush_cache():  # what /flush_cache answers with 400
            raise InvalidInput("flush_cache: cache not flushed: requests are running or hold KV in place")

    def load(self, version: int) -> None:
        self.load_answer = self.engine.updates.update_from_disk(
            UpdateFromDisk(model_path=self.model_path, weight_version=str(version)))

    def resume(self) -> None:
        self.engine.resume()

    def version(self) -> int | None:
        served = self.engine.version
        return int(served) if served.isascii() and served.isdigit() else None


def activate_here(engine: Engine, req: ActivateWeights) -> dict:
    """The lifecycle over ``engine`` itself (blocking: a worker thread's); the answer, or ``ActivationFailed``
    (503: the pause had begun). Refused before anything pauses: a version that is not a number
    (``InvalidInput``, 400), a ``model_path`` outside the roots (``OutsideRoots``, 403)."""
    version = req.version_number()
    if engine.lora is not None and engine.lora.versions is not None:  # an adapter version: nothing pauses
        return engine.lora.versions.activate(version, lambda v: engine.scheduler.call(
            lambda s: setattr(s, "version", v)).result())
    roots = engine.updates.roots
    model_path = req.model_path if req.model_path is not None else str(roots.local(None))
    roots.loadable(model_path)  # a path outside the roots is refused (403) before anything pauses
    port = EngineItself(engine, model_path)
    pause_s = activate(port, version, pause_mode=req.pause_mode, flush=req.flush_cache)
    load = port.load_answer or {}
    return {**one_call_answer(version, pause_s), "activation": load.get("activation"),
            "num_paused_requests": load.get("num_paused_requests"), "load": load}
