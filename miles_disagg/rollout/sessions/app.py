"""The session endpoint's HTTP app (miles' session server routes), on the rollout's event loop.

* ``POST /sessions`` ``{"metadata": {...}}`` -> ``{"session_id", "base_url"}`` (admin key)
* ``GET /sessions`` -> the live sessions' ids (admin key)
* ``GET /sessions/{id}`` -> the session's turns (tokens, cached tokens, versions, worker per turn)
* ``DELETE /sessions/{id}`` -> ``{"deleted": id}``
* ``POST /sessions/{id}/v1/chat/completions`` -> an OpenAI chat completion (``stream: true``: SSE chunks as
  the engine generates them, :mod:`.streaming`)
* ``GET /health`` (open)

Keys: creating and listing sessions take the run's admin key (``Authorization: Bearer``), like the
rest of the run's control plane; a session's own routes are reached through its id, 24 random URL-safe
characters handed only to whoever created it (its ``base_url`` is the capability an agent gets, as
with miles, whose agents call it with no key of the run). Bodies are bounded (:data:`MAX_BODY_BYTES`,
JSON nesting by the parser); every error is ``{"error": {message, type, code, retryable}}`` and
changes nothing.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from miles_disagg.net.auth import ApiKeys, AuthLevel
from miles_disagg.net.httpjson import error_json, parse_json, status_for
from miles_disagg.rollout.sessions.service import SessionService, TooManySessions
from miles_disagg.rollout.sessions.streaming import open_turn_stream
from miles_disagg.rollout.sessions.types import PrefixMismatch, SessionBroken, SessionNotFound

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
STATUS = {SessionNotFound: 404, PrefixMismatch: 409, SessionBroken: 409, TooManySessions: 503}


class SessionServer:
    """The app on a listener of its own (``port`` 0: any free port); :attr:`url` once started."""

    def __init__(self, service: SessionService, keys: ApiKeys, host: str = "127.0.0.1", port: int = 0):
        self.service, self.keys, self.host, self.port = service, keys, host, port
        self._runner = None
        self.url = ""

    async def start(self) -> str:
        from aiohttp import web

        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_get("/health", self._health)
        app.router.add_post("/sessions", self._create)
        app.router.add_get("/sessions", self._list)
        app.router.add_get("/sessions/{sid}", self._get)
        app.router.add_delete("/sessions/{sid}", self._delete)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def base_url(self, session_id: str) -> str:
        """What an agent is given (miles' ``base_url``): OpenAI routes live under ``{base_url}/v1``."""
        return f"{self.url}/sessions/{session_id}"

    # ------------------------------------------------------------------ routes

    async def _health(self, request):
        from aiohttp import web

        return web.json_response({"status": "ok", "live_sessions": len(self.service.sessions)})

    async def _create(self, request):
        return await self._answer(request, lambda body: self._created(body), admin=True)

    def _created(self, body: dict) -> dict:
        metadata = body.get("metadata") or {}
        if not isinstance(metadata, dict):
            from miles_disagg.types import InvalidInput

            raise InvalidInput(f"metadata must be an object, got {type(metadata).__name__}")
        state = self.service.create(metadata)
        return {"session_id": state.session_id, "base_url": self.base_url(state.session_id)}

    async def _list(self, request):
        return await self._answer(request, lambda _: {"sessions": sorted(self.service.sessions)}, admin=True)

    async def _get(self, request):
        sid = request.match_info["sid"]
        return await self._answer(request, lambda _: self.service.get(sid).to_json())

    async def _delete(self, request):
        sid = request.match_info["sid"]
        return await self._answer(request, lambda _: {"deleted": self.service.delete(sid).session_id})

    async def _chat(self, request):
        from aiohttp import web

        sid = request.match_info["sid"]
        try:
            body = await self._body(request)
            if body.get("stream") is True:
                chunks = await open_turn_stream(self.service, sid, body)
            else:
                return web.json_response(await self.service.chat(sid, body))
        except Exception as exc:  # typed errors become their status; anything else is a logged 500
            return _error(exc)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await response.prepare(request)
            async for chunk in chunks:  # each as the engine generates it (rollout/sessions/streaming.py)
                await response.write(chunk)
        finally:
            await chunks.aclose()  # a client that left: the stream to the router closes, nothing is recorded
        await response.write_eof()
        return response

    async def _answer(self, request, handle, admin: bool = False):
        from aiohttp import web

        if admin and self.keys.caller_level(AuthLevel.ADMIN, request.headers.get("Authorization")) is None:
            return web.json_response({"error": {"message": f"{request.path} needs the run's admin key "
                                                           "(Authorization: Bearer <key>)", "type": "Unauthorized",
                                                "code": 401, "retryable": False}}, status=401)
        try:
            body = await self._body(request) if request.method == "POST" else {}
            return web.json_response(handle(body))
        except Exception as exc:  # typed errors become their status; anything else is a logged 500
            return _error(exc)

    @staticmethod
    async def _body(request) -> dict[str, Any]:
        return parse_json(await request.read())


def _error(exc: BaseException):
    from aiohttp import web

    if isinstance(exc, web.HTTPException):  # aiohttp's own refusals (a body over the limit: 413)
        return web.json_response({"error": {"message": exc.text or exc.reason, "type": type(exc).__name__,
                                            "code": exc.status, "retryable": False}}, status=exc.status)
    status = status_for(exc, STATUS)
    return web.json_response(error_json(exc, status), status=status)
