"""Generation requests straight to :meth:`Router.proxy <miles_disagg.router.proxy.Router.proxy>`, past FastAPI.

A pure ASGI middleware the router installs inside :class:`~miles_disagg.net.asgi_guard.GuardMiddleware`
(keys, size limit, slow bodies and the server-id header still apply to every request): a ``POST`` (or
``PUT /generate``) to a generation path is handed to the router's proxy with a Starlette ``Request``
and its answer sent as is, which is what FastAPI's route did, minus its routing, exception and
dependency layers. Those layers were about a third of the router's CPU per proxied request (py-spy
under ``miles-disagg bench scale``). Every other request, and a generation path with another method
(405), goes through the app unchanged. An exception escaping the proxy reaches the server's error
middleware as before (500).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable, Mapping


class GenerationFastPath:
    """``paths``: path -> the methods served here (anything else falls through to ``app``)."""

    def __init__(self, app: Any, *, proxy: Callable[[Any, str], Awaitable[Any]],
                 paths: Mapping[str, frozenset[str]]):
        self.app, self.proxy, self.paths = app, proxy, dict(paths)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            methods = self.paths.get(scope["path"])
            if methods is not None and scope["method"] in methods:
                from starlette.requests import Request

                response = await self.proxy(Request(scope, receive), scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
