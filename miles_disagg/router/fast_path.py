"""Generation requests straight to :meth:`Router.proxy <miles_disagg.router.proxy.Router.proxy>`, past FastAPI.

The router's app (:class:`~miles_disagg.router.app.RouterApp`) hands a ``POST`` (or ``PUT /generate``) to a
generation path to a :class:`~miles_disagg.net.asgi_guard.GuardMiddleware` around a
:class:`GenerationFastPath` before any of FastAPI's layers: keys, size limit, slow bodies and the server-id
header still apply, then the proxy gets a :class:`ProxyRequest` and its answer is sent as is, which is what
FastAPI's route did, minus its routing, exception, telemetry, body-limit and dependency layers and
Starlette's request object. Those layers were about a third of the router's CPU per proxied request, and
FastAPI's outer ones a twentieth more (py-spy under ``miles-disagg bench scale``). Every other request, and
a generation path with another method (405), goes through the app unchanged. An exception escaping the
proxy reaches the server, which answers 500 as before.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Awaitable, Callable, Mapping


class ProxyRequest:
    """What the proxy reads of a request: :meth:`body`, ``headers`` (lower-case names), ``state`` (the
    guard's ``auth_level``) and ``receive`` (to watch for the client leaving)."""

    __slots__ = ("receive", "headers", "state", "_body")

    def __init__(self, scope: dict, receive: Callable[[], Awaitable[dict]]):
        self.receive = receive
        self.headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        self.state = SimpleNamespace(**scope.get("state", {}))
        self._body: bytes | None = None

    async def body(self) -> bytes:
        """The whole body (the guard hands it over in one message)."""
        if self._body is None:
            chunks = []
            while True:
                message = await self.receive()
                chunks.append(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body", False):
                    break
            self._body = b"".join(chunks)
        return self._body


class GenerationFastPath:
    """``paths``: path -> the methods served here (anything else goes to ``app``, when one is given)."""

    def __init__(self, app: Any = None, *, proxy: Callable[[Any, str], Awaitable[Any]],
                 paths: Mapping[str, frozenset[str]]):
        self.app, self.proxy, self.paths = app, proxy, dict(paths)

    def serves(self, scope: dict) -> bool:
        """Whether ``scope`` is a generation request this path serves."""
        methods = self.paths.get(scope["path"]) if scope["type"] == "http" else None
        return methods is not None and scope["method"] in methods

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.serves(scope):
            response = await self.proxy(ProxyRequest(scope, receive), scope["path"])
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
