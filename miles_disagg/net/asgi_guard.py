"""The ASGI middleware every server of this project runs first: API keys and the request-size limit.

:func:`install_guard` wraps a FastAPI app (engine, agent, router, gateway, replica control API):

1. **Keys** (:mod:`miles_disagg.net.auth`): the endpoint's level from its path; a caller without the
   key it needs gets ``401`` JSON before the app sees the request. The level the caller proved is
   left in ``scope["state"]["auth_level"]`` (``request.state.auth_level``) for proxies.
2. **Size**: a ``Content-Length`` above ``max_request_bytes`` is ``413`` at once, before a byte
   of the body is read (no waiting on a body that may never come); what the client sends after
   is read and dropped only while it keeps coming at least at the rate floor (point 3)
   (up to :data:`DRAIN_CAP_BYTES`), so a client that sends first and reads after still sees the
   answer rather than a reset connection. A body without a length (chunked) is counted as it
   streams and refused as soon as it passes the limit, so no server ever holds more than the
   limit of one request.
3. **Slow bodies**: the body is read by the guard and handed to the app whole; it must arrive
   within ``body_grace_s`` plus its size at ``min_body_bytes_per_s`` (:class:`ServerGuard`), else ``408`` (a body
   trickled in to hold connections open is cut off, whatever its declared length).
4. **Identity**: every answer carries :data:`SERVER_ID_HEADER`, random per app (``app.state.server_id``),
   so a proxy can tell it has been handed its own address (or any alias of it) as an upstream.

Error bodies carry every shape our clients read: SGLang's ``success``/``message``, the router's
``type``/``retryable`` and ``{"error": {message, type, code, retryable}}``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from miles_disagg.net.auth import ApiKeys, level_of

DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024
DRAIN_CAP_BYTES = 256 * 1024 * 1024  # an oversized body is read and dropped up to this, so the client sees its 413
MIN_BODY_BYTES_PER_S = 64 * 1024  # a body (or the rest of a refused one) must keep coming at least this fast
BODY_GRACE_S = 10.0  # ... after this much time to start
DRAIN_GRACE_S = 1.0  # the grace of the rest of a refused body: its sender already has the 413
SERVER_ID_HEADER = "x-miles-disagg-server-id"  # a proxy refuses an upstream that answers with its own
MAX_REQUEST_BYTES_HELP = ("Largest request body accepted; a bigger one is refused with 413 before it is read "
                          "(0: no limit).")

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


def server_app(title: str, app_class: type | None = None, **options: Any):
    """A FastAPI app (or ``app_class``, a subclass) for one of the project's servers. FastAPI's own
    OpenTelemetry instrumentation (FastAPI >= 0.160) stays off: with no provider configured it still looks
    the providers up on every request, about a tenth of a proxied request's CPU in the router."""
    import inspect

    from fastapi import FastAPI

    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        options.setdefault("telemetry", {"tracing": False, "metrics": False, "logs": False})
    return (app_class or FastAPI)(title=title, **options)


@dataclass(frozen=True)
class ServerGuard:
    """What :func:`install_guard` enforces."""

    keys: ApiKeys = field(default_factory=ApiKeys)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    """0: no limit."""
    body_grace_s: float = BODY_GRACE_S
    """Time a body may take to start arriving (see ``min_body_bytes_per_s``)."""
    min_body_bytes_per_s: int = MIN_BODY_BYTES_PER_S
    """A body must arrive within ``body_grace_s`` plus its size at this rate, else 408."""

    def __post_init__(self) -> None:
        if self.max_request_bytes < 0:
            raise ValueError(f"--max-request-bytes must be >= 0, got {self.max_request_bytes}")
        if not (self.body_grace_s > 0 and self.min_body_bytes_per_s > 0):
            raise ValueError(f"body_grace_s and min_body_bytes_per_s must be > 0, got {self.body_grace_s}, "
                             f"{self.min_body_bytes_per_s}")

    @classmethod
    def from_env(cls) -> "ServerGuard":
        """Keys from the environment (:data:`~miles_disagg.net.auth.API_KEY_ENV` ...), the default limit."""
        return cls(ApiKeys.from_env())


def install_guard(app: Any, guard: ServerGuard | None = None, server_id: str | None = None) -> ServerGuard:
    """Add the guard to ``app`` (``None``: :meth:`ServerGuard.from_env`); returns what it enforces.
    ``server_id``: the id its answers carry (default: a new random one; the processes of one server share one)."""
    guard = guard if guard is not None else ServerGuard.from_env()
    app.state.server_id = server_id or secrets.token_hex(8)
    app.add_middleware(GuardMiddleware, guard=guard, server_id=app.state.server_id)
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

    def __init__(self, app: Any, *, guard: ServerGuard, server_id: str = ""):
        self.app, self.guard = app, guard
        self._id_header = (SERVER_ID_HEADER.encode(), server_id.encode())

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
        send = _with_header(send, self._id_header)
        limit = self.guard.max_request_bytes
        length = _content_length(headers)
        if limit and length is not None and length > limit:
            await _refuse_too_large(receive, send, _too_large(length, limit), headers, self.guard)
            return
        await self._buffered(scope, receive, send, limit, headers)

    async def _buffered(self, scope: Scope, receive: Receive, send: Send, limit: int, headers: dict[str, str]) -> None:
        """Read the body (up to the limit, at the rate floor), then replay it to the app."""
        chunks, size = [], 0
        deadline = _BodyDeadline(self.guard)
        while True:
            try:
                message = await deadline.receive(receive, size)
            except asyncio.TimeoutError:
                await send_json(send, 408, error_body(408, "RequestTimeout", deadline.message(size)),
                                headers=((b"connection", b"close"),))
                return
            if message["type"] != "http.request":  # the client left
                return
            size += len(message.get("body", b""))
            if limit and size > limit:
                more = message.get("more_body", False)
                await _refuse_too_large(receive if more else None, send, _too_large(size, limit, partial=True), headers,
                                        self.guard)
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


class _BodyDeadline:
    """A body must arrive within the guard's grace plus its size at the guard's rate floor."""

    def __init__(self, guard: ServerGuard, grace_s: float | None = None) -> None:
        self.started = time.monotonic()
        self.grace_s = guard.body_grace_s if grace_s is None else grace_s
        self.rate = guard.min_body_bytes_per_s

    def remaining_s(self, received: int) -> float:
        return self.started + self.grace_s + received / self.rate - time.monotonic()

    async def receive(self, receive: Receive, received: int) -> dict:
        """The next message; ``asyncio.TimeoutError`` when the body is behind the floor. (``asyncio.timeout``,
        not ``wait_for``: no task per message, which was a twentieth of the router's CPU per request.)"""
        remaining_s = max(0.0, self.remaining_s(received))
        if not hasattr(asyncio, "timeout"):  # Python 3.10
            return await asyncio.wait_for(receive(), remaining_s)
        async with asyncio.timeout(remaining_s):
            return await receive()

    def message(self, received: int) -> str:
        return (f"request body too slow: {received} bytes in {time.monotonic() - self.started:.1f} s; this server "
                f"needs the body within {self.grace_s:g} s plus {self.rate} bytes/s")


def _with_header(send: Send, header: tuple[bytes, bytes]) -> Send:
    async def send_with_header(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), header]}
        await send(message)
    return send_with_header


async def _refuse_too_large(receive: Receive | None, send: Send, message: str, headers: dict[str, str],
                            guard: ServerGuard) -> None:
    """413 at once, then drop what is left of the body while it keeps coming at the rate floor
    (``receive`` None: nothing is left), so a client that reads only after sending sees the 413.

    The whole answer (its length declared) is sent before the drain; only the end of the response
    waits for it, because the server stops handing the app the body once the response is complete."""
    payload = json.dumps(error_body(413, "RequestTooLarge", message)).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload, "more_body": True})
    if receive is not None and "100-continue" not in headers.get("expect", "").lower():
        await _drain(receive, guard)
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _drain(receive: Receive, guard: ServerGuard) -> None:
    dropped, deadline = 0, _BodyDeadline(guard, grace_s=min(guard.body_grace_s, DRAIN_GRACE_S))
    while dropped <= DRAIN_CAP_BYTES:
        try:
            chunk = await deadline.receive(receive, dropped)
        except asyncio.TimeoutError:
            return  # a slow or stalled sender: the connection closes now
        if chunk["type"] != "http.request" or not chunk.get("more_body", False):
            return
        dropped += len(chunk.get("body", b""))


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
