"""The agent: host-side ``/pull_weights`` for an engine that lacks it, plus a transparent proxy.

Endpoints the agent answers itself (everything else is proxied unchanged):

* ``POST /pull_weights`` ``{target_version, source_dir, local_checkpoint_dir?}``: materialize
  and verify ``target_version`` into the local checkpoint while the engine keeps serving.
  The engine is never called (so never paused); a failure leaves the held version held.
* ``POST /update_weights_from_disk``: a decimal ``weight_version`` must name the version the
  agent holds; ``model_path`` is then rewritten to the slot directory holding exactly that
  version and the request forwarded. Any other decimal version is refused (400,
  ``VersionNotPrepared``) without calling the engine: one policy is never loaded under
  another's label. A ``model_path`` naming the agent's local checkpoint is rewritten to the
  held slot too. The base checkpoint may be loaded too (as version 0). Any other path is
  403 naming the allowed roots, and a label that is not the version the loaded checkpoint
  holds is 403 (version labels come only from verified weights; the label forwarded is always
  that version).
* ``POST /activate_weights`` ``{weight_version, pause_mode?, flush_cache?, model_path?}``: activate
  the held version in one call: the agent pauses its engine, flushes, loads the held slot, continues
  and checks the served version (:mod:`miles_disagg.engines.agent.one_call`); 400 before anything
  paused for a version the agent does not hold, 503 naming each fault once the pause began.
* ``POST /update_weight_version``: refused (403) unless it names the version the engine
  already serves: relabelling without a verified load would serve one policy under another's name.
* ``GET /agent_info`` (state), ``GET /agent_health`` (the agent itself is up).

Keys (:mod:`miles_disagg.net.auth`): the agent enforces its own ``--api-key``/``--admin-api-key``
and talks to the engine with the same keys, but a proxied request carries a key of at most
the level its caller proved, so nobody borrows the agent's admin key. ``/pull_weights``
reads only a ``--weight-store-dir`` and writes only the agent's local checkpoint (403 otherwise).

The host state (held version, slots, pulls, activations in flight) and its ordering contracts are
:class:`~miles_disagg.engines.agent.state.Agent`'s. Pulls run on worker threads, so the proxy keeps
answering during a pull. Engine unreachable (connect/transport failure) is a
502 JSON error. Errors are ``{"success": false, "message", "error": {message, type, code,
retryable}}``: 400 bad input or a refused update (``InvalidInput``, ``FailRun``: lineage,
checksum, layout, format), 409 retryable (``VersionNotReady``), 502 engine unreachable.
"""

# no "from __future__ import annotations": FastAPI must see the real Request class

import asyncio
import contextlib
import json
import logging
from pathlib import Path

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from miles_disagg.engines.activation import ACTIVATE_PATH
from miles_disagg.engines.agent.adapters import AgentAdapters
from miles_disagg.engines.agent.one_call import activate_adapter, activate_through, check_request
from miles_disagg.engines.agent.state import Agent
from miles_disagg.engines.async_client import AsyncEngineClient
from miles_disagg.engines.builtin import control_bodies
from miles_disagg.engines.builtin.one_call import ActivateWeights
from miles_disagg.engines.roots import inside_lora_roots
from miles_disagg.net.asgi_guard import install_guard, server_app
from miles_disagg.net.auth import ApiKeys, forward_headers
from miles_disagg.net.httpjson import error_json, parse_json
from miles_disagg.net.httpjson import status_for as _status_for
from miles_disagg.net.keyed_client import pooled_limits
from miles_disagg.net.pooled_http import PooledSession
from miles_disagg.types import EngineUnreachable, Forbidden, InvalidInput, VersionRef

log = logging.getLogger(__name__)

# Headers that describe one hop, not the message; never forwarded (content-length is recomputed
# for requests; for responses the raw upstream bytes are relayed, so its length stays right).
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host"})
SERVER_SET = frozenset({"date", "server"})  # the agent's own HTTP server adds these
PROXY_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]


# --------------------------------------------------------------------------- errors


def status_for(exc: BaseException) -> int:
    """The HTTP status of an agent error: as every server's, and 502 for an unreachable engine."""
    return _status_for(exc, {EngineUnreachable: 502})


def error_response(exc: BaseException):
    """The agent's JSON error answer: ``{"success": false, "message", "error": {...}}``."""
    status = status_for(exc)
    body = error_json(exc, status)
    return JSONResponse({"success": False, "message": body["error"]["message"], **body}, status_code=status)


def _unreachable(engine_url: str, exc: Exception) -> EngineUnreachable:
    return EngineUnreachable(f"engine at {engine_url} is unreachable: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- HTTP app


class AgentEndpoints:
    """The agent's endpoints over one :class:`Agent`, one method per route; ``client`` reaches the engine,
    ``keys`` are the agent's (enforced by its guard, sent to the engine at the level a caller proved)."""

    def __init__(self, agent: Agent, client: httpx.AsyncClient, keys: ApiKeys):
        self.agent, self.client, self.keys = agent, client, keys
        self.control_session: PooledSession | None = None

    async def agent_health(self):
        return {"status": "ok"}

    async def agent_info(self):
        return self.agent.info()

    async def weight_checksums(self, algorithm: str = "xxh3-128"):
        try:
            result = await asyncio.get_running_loop().run_in_executor(None, self.agent.checkpoint_checksums, algorithm)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(result)

    async def pull_weights(self, request: Request):
        agent = self.agent
        try:
            body = parse_json(await request.body())
            req = control_bodies.PullWeights.from_json({"local_checkpoint_dir": str(agent.local_dir), **body})
            await self._ensure_base_dir()
            result = await asyncio.get_running_loop().run_in_executor(None, agent.pull, req)
        except Exception as exc:
            return error_response(exc)
        return JSONResponse(result)

    async def update_weights_from_disk(self, request: Request):
        agent = self.agent
        try:
            if agent.adapters is not None:
                raise InvalidInput("this agent serves a run's LoRA adapter versions (--lora-base-dir): they are "
                                   "loaded beside the base by /activate_weights, never as the model's weights")
            body = parse_json(await request.body())
            req = control_bodies.UpdateFromDisk.from_json(body)
            by_version = req.weight_version is not None and _is_version_number(req.weight_version)
            if req.weight_version is not None and not by_version:
                raise Forbidden(f"weight_version {req.weight_version!r} is not a version number; labels come only "
                                "from verified weights (the version the loaded checkpoint holds)")
            if not agent.names_local_checkpoint(req.model_path):
                await self._ensure_base_dir()
                agent.roots().loadable(req.model_path)  # OutsideRoots (403) unless it is the base checkpoint
                if not by_version or req.weight_version == "0":
                    label = agent.check_label(req.weight_version, VersionRef("", 0))
                    return await self._forward(request, json.dumps({**body, "weight_version": label}).encode())
            path, ref = agent.begin_activation(req.weight_version if by_version else None)
        except Exception as exc:
            return error_response(exc)
        return await self._activate(request, {**body, "model_path": str(path), "weight_version": str(ref.version)},
                                    path, ref)

    async def activate_weights(self, request: Request):
        try:
            req = ActivateWeights.from_json(await request.body())
            check_request(self.agent, req)  # nothing pauses for a version the agent does not hold
            engine = AsyncEngineClient(self.agent.engine_url, await self._control_session(), keys=self.keys)
            if self.agent.adapters is not None:  # a run's LoRA adapter version: loaded beside, nothing pauses
                return JSONResponse(await activate_adapter(self.agent, engine, req))
            return JSONResponse(await activate_through(self.agent, engine, req))
        except Exception as exc:
            return error_response(exc)

    async def _control_session(self) -> PooledSession:
        """The session of the activation's requests to the engine (made on the app's loop, at first use)."""
        if self.control_session is None:
            self.control_session = PooledSession(max_connections=None, read_timeout_s=None,
                                                 connect_timeout_s=self.agent.config.connect_timeout_s)
        return self.control_session

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.control_session is not None:
            await self.control_session.aclose()

    async def update_weight_version(self, request: Request):
        raw = await request.body()
        try:
            req = control_bodies.UpdateWeightVersion.from_json(raw)
            serving = str((await self._engine_json("/get_weight_version")).get("weight_version"))
            if req.new_version != serving:
                raise Forbidden(f"relabelling the engine's weights (version {serving}) as {req.new_version!r} without "
                                "loading them is refused: version labels come only from verified weights")
        except Exception as exc:
            return error_response(exc)
        return await self._forward(request, raw)

    async def load_lora_adapter(self, request: Request):
        """SGLang's ``/load_lora_adapter``, forwarded only for an adapter under ``--lora-root`` (else 403)."""
        raw = await request.body()
        try:
            inside_lora_roots(control_bodies.LoadLoraAdapter.from_json(raw).lora_path, self.agent.config.lora_roots)
        except Exception as exc:
            return error_response(exc)
        return await self._forward(request, raw)

    async def proxy(self, request: Request, path: str):
        adapters = self.agent.adapters
        if adapters is not None and request.method == "POST" and path == "generate":
            return await self._generate_on_adapter(request, adapters)
        if adapters is not None and request.method == "GET" and path in ("model_info", "get_model_info"):
            return await self._model_info(request, adapters)
        return await self._forward(request, await request.body())

    async def _generate_on_adapter(self, request: Request, adapters: AgentAdapters):
        """``/generate`` pinned to an adapter version (the served one where the body names none), its
        answer's ``meta_info`` naming that version (:meth:`AgentAdapters.label`)."""
        try:
            pinned = adapters.pin(parse_json(await request.body()))
        except Exception as exc:
            return error_response(exc)
        content = json.dumps(pinned).encode()
        if not isinstance(pinned, dict):
            return await self._forward(request, content)
        if pinned.get("stream"):
            return await self._forward(request, content, relabel=lambda chunks: adapters.label_stream(pinned, chunks))
        try:
            response = await self.client.post(request.url.path, content=content,
                                              headers=self._upstream_headers(request, request.url.path))
        except httpx.TransportError as exc:
            return error_response(_unreachable(self.agent.engine_url, exc))
        try:
            answer = response.json()
        except ValueError:
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        if response.status_code == 200:
            answer = adapters.label(pinned, answer)
        return JSONResponse(answer, status_code=response.status_code)

    async def _model_info(self, request: Request, adapters: AgentAdapters):
        """The engine's ``/model_info`` with the adapter versions resident (``resident_weight_versions``)."""
        try:
            response = await self.client.get(request.url.path, headers=self._upstream_headers(request, request.url.path))
        except httpx.TransportError as exc:
            return error_response(_unreachable(self.agent.engine_url, exc))
        try:
            answer = response.json()
        except ValueError:
            answer = None
        if response.status_code != 200 or not isinstance(answer, dict):
            return Response(response.content, status_code=response.status_code,
                            media_type=response.headers.get("content-type"))
        resident = adapters.resident_map()
        return JSONResponse({**answer, "resident_weight_versions": resident} if resident else answer)

    # ---------------------------------------------------------------- towards the engine

    def _upstream_headers(self, request: Request, path: str) -> list[tuple[str, str]]:
        """The caller's headers without its key, plus ours at no more than the level it proved."""
        level = getattr(request.state, "auth_level", None)
        return _request_headers(request) + list(forward_headers(self.keys, level, path).items())

    async def _engine_json(self, path: str) -> dict:
        try:
            response = await self.client.get(path, headers=self.keys.headers_for(path))
        except httpx.TransportError as exc:
            raise _unreachable(self.agent.engine_url, exc) from exc
        if response.status_code != 200:
            raise EngineUnreachable(f"engine GET {path} answered {response.status_code}: {response.text[:200]}")
        return response.json()

    async def _ensure_base_dir(self) -> None:
        if self.agent.base_dir is None:
            info = await self._engine_json("/model_info")
            if not info.get("model_path"):
                info = await self._engine_json("/server_info")
            self.agent.set_base_dir(str(info.get("model_path") or ""))

    async def _activate(self, request: Request, body: dict, path: Path, ref: VersionRef):
        """Forward the rewritten activation; the slot counts as being read until the engine answers."""
        status, error = None, "cancelled"
        try:
            response = await self.client.post("/update_weights_from_disk", json=body,
                                              headers=self._upstream_headers(request, "/update_weights_from_disk"))
            status = response.status_code
            error = None if status == 200 else f"engine answered {status}: {response.text[:500]}"
        except httpx.TransportError as exc:
            failure = _unreachable(self.agent.engine_url, exc)
            error = str(failure)
            return error_response(failure)
        finally:
            self.agent.end_activation(path, ref, status, error)
        return _relay_with_path(response, path)

    async def _forward(self, request: Request, body: bytes, relabel=None):
        """``request`` with ``body`` to the engine, its answer relayed as it arrives (hop-by-hop headers
        dropped); ``relabel``: rewrites a 200 answer's byte stream (its length then recomputed)."""
        client = self.client
        url = httpx.URL(path=request.url.path, query=request.url.query.encode())
        upstream_request = client.build_request(request.method, url,
                                                headers=self._upstream_headers(request, request.url.path), content=body)
        try:
            upstream = await client.send(upstream_request, stream=True)
        except httpx.TransportError as exc:
            return error_response(_unreachable(self.agent.engine_url, exc))
        rewrite = relabel is not None and upstream.status_code == 200
        response = StreamingResponse(relabel(_relay(upstream)) if rewrite else _relay(upstream),
                                     status_code=upstream.status_code)
        dropped = HOP_BY_HOP | SERVER_SET | ({"content-length"} if rewrite else set())
        response.raw_headers = [(k, v) for k, v in upstream.headers.raw if k.decode("latin-1").lower() not in dropped]
        return response


def create_app(agent: Agent):
    """The agent's ASGI app (its guard from ``agent.config.guard``); its lifespan closes the engine clients."""
    timeout = httpx.Timeout(None, connect=agent.config.connect_timeout_s)  # generations may run for minutes
    client = httpx.AsyncClient(base_url=agent.engine_url, timeout=timeout, limits=pooled_limits())

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        await api.aclose()

    app = server_app("miles-disagg agent", lifespan=lifespan)
    api = AgentEndpoints(agent, client, install_guard(app, agent.config.guard).keys)
    for path, endpoint, methods in (
        ("/agent_health", api.agent_health, ["GET"]),
        ("/agent_info", api.agent_info, ["GET"]),
        ("/weight_checksums", api.weight_checksums, ["GET"]),
        ("/pull_weights", api.pull_weights, ["POST"]),
        ("/update_weights_from_disk", api.update_weights_from_disk, ["POST"]),
        (ACTIVATE_PATH, api.activate_weights, ["POST"]),
        ("/update_weight_version", api.update_weight_version, ["POST"]),
        ("/load_lora_adapter", api.load_lora_adapter, ["POST"]),
        ("/{path:path}", api.proxy, PROXY_METHODS),  # last: everything else goes to the engine
    ):
        app.add_api_route(path, endpoint, methods=methods)
    return app


def _is_version_number(label: str) -> bool:
    """This project's version labels are ASCII decimal ints ("7"); others are the client's own labels."""
    return label.isascii() and label.isdigit()


def _request_headers(request) -> list[tuple[str, str]]:
    """The caller's headers minus hop-by-hop ones, its length (recomputed) and its key (never forwarded)."""
    return [(k, v) for k, v in request.headers.items()
            if k.lower() not in HOP_BY_HOP and k.lower() not in ("content-length", "authorization")]


async def _relay(upstream):
    """The engine's raw bytes as they arrive (SSE streams included); the upstream closes when done or dropped."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


def _relay_with_path(response, path: Path):
    """The engine's activation answer; a JSON object gains ``loaded_path`` (the slot it read)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        return JSONResponse({**body, "loaded_path": str(path)}, status_code=response.status_code)
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type"))
