"""The agent's one-call activation (``POST /activate_weights``) in front of an engine that lacks it.

The agent runs :mod:`miles_disagg.engines.activation`'s lifecycle towards its engine, sending exactly
the requests the updater's per-step sequence sends through the agent (``/pause_generation``,
``/flush_cache``, ``/update_weights_from_disk`` naming the slot that holds the version,
``/continue_generation``, ``/model_info``), from the engine's host: the engine's pause holds no round
trip to the updater. Failure rules and records are the per-step sequence's: the held version is
checked before anything pauses (``VersionNotPrepared``, 400); once the pause began any fault is
``ActivationFailed`` and the engine is continued whatever happened; the load is registered and
recorded (``last_activation``, ``last_error``) as a proxied ``/update_weights_from_disk`` is.
"""

from __future__ import annotations

from pathlib import Path

from miles_disagg.engines.activation import activate_async, one_call_answer
from miles_disagg.engines.agent.state import Agent
from miles_disagg.engines.async_client import AsyncEngineClient
from miles_disagg.engines.builtin.one_call import ActivateWeights
from miles_disagg.engines.roots import OutsideRoots
from miles_disagg.types import EngineUnreachable

LOAD_PATH = "/update_weights_from_disk"


class EngineThroughAgent:
    """The activation port towards the agent's engine for one activation; :meth:`load` reads the held slot."""

    one_call_activation = False  # this port *is* the one call's steps

    def __init__(self, agent: Agent, engine: AsyncEngineClient):
        self.agent, self.engine = agent, engine
        self.loaded: tuple[Path, dict] | None = None  # the slot read and the engine's answer

    async def pull(self, version: int) -> object:
        raise NotImplementedError("an activation does not pull")

    async def pause(self, mode: str) -> None:
        await self.engine.pause(mode)

    async def flush(self) -> None:
        await self.engine.flush()

    async def load(self, version: int) -> None:
        """The held slot, registered as being read until the engine answered (as a proxied load)."""
        path, ref = self.agent.begin_activation(str(version))
        status, error = None, "cancelled"
        try:
            reply = await self.engine.send("POST", LOAD_PATH, {"model_path": str(path), "weight_version": str(ref.version)})
            status, error = reply.status_code, f"engine answered {reply.status_code}: {reply.text[:500]}"
            answer = self.engine.checked(reply, LOAD_PATH)
            error = None
        except EngineUnreachable as exc:
            error = str(exc)
            raise
        finally:
            self.agent.end_activation(path, ref, status, error)
        self.loaded = (path, answer)

    async def resume(self) -> None:
        await self.engine.resume()

    async def version(self) -> int | None:
        return await self.engine.version()


def check_request(agent: Agent, req: ActivateWeights) -> int:
    """The version to activate, checked before anything pauses: a decimal version the agent holds, and
    no ``model_path`` but the agent's local checkpoint (``InvalidInput``/``VersionNotPrepared``/``OutsideRoots``)."""
    version = req.version_number()
    if req.model_path is not None and not agent.names_local_checkpoint(req.model_path):
        raise OutsideRoots(f"model_path {req.model_path!r} is not this agent's local checkpoint "
                           f"({str(agent.local_dir)!r}); /activate_weights activates only the version it prepared")
    agent.check_prepared(version)
    return version


async def activate_through(agent: Agent, engine: AsyncEngineClient, req: ActivateWeights) -> dict:
    """The lifecycle towards ``engine`` for a request :func:`check_request` accepted; the answer (the
    engine's load answer under ``load``, the slot under ``loaded_path``) or ``ActivationFailed``."""
    version = check_request(agent, req)
    port = EngineThroughAgent(agent, engine)
    pause_s = await activate_async(port, version, pause_mode=req.pause_mode, flush=req.flush_cache)
    path, load = port.loaded if port.loaded is not None else (None, {})
    return {**one_call_answer(version, pause_s), "loaded_path": str(path) if path else None, "load": load}


async def activate_adapter(agent: Agent, engine: AsyncEngineClient, req: ActivateWeights) -> dict:
    """``--lora-base-dir``: serve the held adapter version beside the resident ones, without a pause
    (:mod:`miles_disagg.engines.agent.adapters`); recorded as any activation is (``last_activation``)."""
    import asyncio

    version = check_request(agent, req)
    path, ref = agent.begin_activation(str(version))
    status, error = None, "cancelled"
    try:
        directory = await asyncio.get_running_loop().run_in_executor(None, agent.adapters.stage, version, path)
        answer = await agent.adapters.activate(engine, version, directory)
        status, error = 200, None
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        agent.end_activation(path, ref, status, error)
    return {**answer, "loaded_path": str(directory)}
