"""The ASGI middleware every server of this project runs first: API keys and the request-size limit.

:func:`install_guard` wraps a FastAPI app (engine, agent, router, gateway, replica control API):

1. **Keys** (:mod:`miles_disagg.auth`): the endpoint's level from its path; a caller without the
   key it needs gets ``401`` JSON before the app sees the request. The level the caller proved is
   left in ``scope["state"]["auth_level"]`` (``request.state.auth_level``) for proxies.
2. **Size**: a ``Content-Length`` above ``max_request_bytes`` is ``413`` before a byte of the body
   is handed to the app; a body without a length (chunked) is counted as it streams and refused
   as soon as it passes the limit, so no server ever holds more than the limit of one request.
   The rest of an oversized body is read and dropped (up to :data:`DRAIN_CAP_BYTES`, nothing
   kept) before the ``413`` is sent, so a client that sends first and reads after sees the
   answer rather than a reset connection; a client that asked ``Expect: 100-continue`` gets
   the ``413`` at once and never sends the body.

Error bodies carry every shape our clients read: SGLang's ``success``/``message``, the router's
``type``/``retryable`` and ``{"error": {message, type, code, retryable}}``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from miles_disagg.auth import ApiKeys, level_of

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DRAIN_CAP_BYTES = 256 * 1024 * 1024  # an oversized body is read and dropped up to this, so the client sees its 413
MAX_REQUEST_BYTES_HELP = ("Largest request body accepted; a bigger one is refused with 413 before it is read "
                          "(0: no limit).")

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def server_app(title: str, **options: Any):
    """A FastAPI app for one of the project's servers. FastAPI's own OpenTelemetry instrumentation
    (FastAPI >= 0.160) stays off: with no provider configured it still looks the providers up on
    every request, about a tenth of a proxied request's CPU in the router."""
    import inspect

    from fastapi import FastAPI

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        options.setdefault("telemetry", {"tracing": False, "metrics": False, "logs": False})
    return FastAPI(title=title, **options)


@dataclass(frozen=True)
class ServerGuard:
    """What :func:`install_guard` enforces."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """0: no limit."""

    def __post_init__(self) -> None:
        if self.max_request_bytes < 0:
            raise ValueError(f"--max-request-bytes must be >= 0, got {self.max_request_bytes}")

    @classmethod
    def from_env(cls) -> "ServerGuard":
        """Keys from the environment (:data:`~miles_disagg.auth.API_KEY_ENV` ...), the default limit."""
        return cls(ApiKeys.from_env())


def install_guard(app: Any, guard: ServerGuard | None = None) -> ServerGuard:
    """Add the guard to ``app`` (``None``: :meth:`ServerGuard.from_env`); returns what it enforces."""
    guard = guard if guard is not None else ServerGuard.from_env()
    app.add_middleware(GuardMiddleware, guard=guard)
    app.state.guard = guard
    return guard


def error_body(status: int, kind: str, message: str) -> dict:
    return {"success": False, "message": message, "type": kind, "retryable": False,
            "error": {"message": message, "type": kind, "code": status, "retryable": False}}


async def send_json(send: Send, status: int, body: dict, headers: tuple = ()) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": payload})


class GuardMiddleware:
    """See the module docstring. Pure ASGI (no ``BaseHTTPMiddleware``), so streaming responses
    and client-disconnect events pass through untouched."""

    def __init__(self, app: Any, *, guard: ServerGuard):
        self.app, self.guard = app, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        path = scope.get("path", "")
        level = self.guard.keys.caller_level(level_of(path), headers.get("authorization"))
        if level is None:
            await send_json(send, 401, error_body(401, "Unauthorized", _unauthorized(path, headers)),
                            headers=((b"www-authenticate", b"Bearer"),))
            return
        scope.setdefault("state", {})["auth_level"] = level
        limit = self.guard.max_request_bytes
        if not limit:
            await self.app(scope, receive, send)
            return
        length = _content_length(headers)
        if length is not None and length > limit:
            await _refuse_too_large(receive, send, _too_large(length, limit), headers)
            return
        if length is not None:  # the server never delivers more than Content-Length
            await self.app(scope, receive, send)
            return
        await self._counted(scope, receive, send, limit, headers)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, limit: int, headers: dict[str, str]) -> None:
        """A body of unknown length: read it up to the limit, then replay it to the app."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if size > limit:
                more = message.get("more_body", False)
                await _refuse_too_large(receive if more else None, send, _too_large(size, limit, partial=True), headers)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _refuse_too_large(receive: Receive | None, send: Send, message: str, headers: dict[str, str]) -> None:
    """413, after dropping what is left of the body (``receive`` None: nothing is left)."""
    if receive is not None and "100-continue" not in headers.get("expect", "").lower():
        dropped = 0
        while dropped <= DRAIN_CAP_BYTES:
            chunk = await receive()
            if chunk["type"] != "http.request":
                return  # the client left
            dropped += len(chunk.get("body", b""))
            if not chunk.get("more_body", False):
                break
    await send_json(send, 413, error_body(413, "RequestTooLarge", message))


def _content_length(headers: dict[str, str]) -> int | None:
    raw = headers.get("content-length")
    if raw is None:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        return None  # the HTTP server refuses a malformed length itself; count the bytes to be safe


def _too_large(size: int, limit: int, partial: bool = False) -> str:
    what = f"more than {limit} bytes were sent" if partial else f"Content-Length is {size}"
    return f"request body too large: {what}; this server's --max-request-bytes is {limit}"


def _unauthorized(path: str, headers: dict[str, str]) -> str:
    given = "a wrong key" if headers.get("authorization") else "no key"
    return f"{path} needs 'Authorization: Bearer <key>' with this server's key; the request carried {given}"
