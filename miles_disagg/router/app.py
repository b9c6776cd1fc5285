"""The version-aware router's HTTP app: FastAPI over a :class:`~miles_disagg.router.proxy.Router`.

Generation (each request proxied to one worker; contracts in :mod:`miles_disagg.router.proxy`):
``POST /generate`` (SGLang body; PUT too), ``POST /v1/completions``, ``POST /v1/chat/completions``.
These are served by :class:`~miles_disagg.router.fast_path.GenerationFastPath`, past FastAPI's
routing; their routes are listed here only for the schema and 405s.

Registry: ``POST /add_worker`` and ``POST /remove_worker`` (``{"url"}`` or ``?url=``),
``GET /list_workers``, ``POST /set_worker_state`` ``{"url", "state": ready|paused|activating,
"weight_version"?}``. A worker's version is learned only from the worker (probes and its
answers): a ``weight_version`` given to ``/set_worker_state`` is checked against a probe of the
worker and refused (409, nothing changed) when the worker reports another. Errors: 404 unknown
worker, 400 bad input, 409 otherwise. ``GET /health`` (router alive), ``GET /metrics`` (JSON counters).
A router of several processes (``--router-workers N``, :mod:`miles_disagg.router.peers`) answers these
from its leader, with every process's load and counters summed, and ``router_workers`` in ``/health`` and
``/metrics`` (processes configured and serving).

Keys and limits (:mod:`miles_disagg.net.asgi_guard`): ``--api-key``/``--admin-api-key`` guard the
router's own endpoints (the registry ones need the admin key); towards workers the router
sends its own keys, never the client's, and never above the level the client proved.
"""

# no "from __future__ import annotations": FastAPI must see the real Request class

import contextlib
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from miles_disagg.net.asgi_guard import GuardMiddleware, ServerGuard, install_guard, server_app
from miles_disagg.net.httpjson import parse_body
from miles_disagg.router.config import RouterConfig
from miles_disagg.router.fast_path import GenerationFastPath
from miles_disagg.router.proxy import GENERATE_PATH, OPENAI_PATHS, Router, WorkerVersionMismatch
from miles_disagg.router.replies import error_response
from miles_disagg.router.registry import UnknownWorker, WorkerRegistry, WorkerState, parse_version
from miles_disagg.types import InvalidInput, MilesDisaggError


@dataclass(frozen=True)
class WorkerRequest:
    """Body of ``/add_worker``, ``/remove_worker`` and ``/set_worker_state`` (the url may come as ``?url=``)."""

    url: str | None = None
    state: str | None = None
    """``ready``, ``paused`` or ``activating`` (``/set_worker_state``; checked by the registry)."""
    weight_version: Any = None
    """The version the worker now holds: a non-negative int or decimal string (``/set_worker_state``)."""

    def __post_init__(self) -> None:
        if self.weight_version is not None and parse_version(self.weight_version) is None:
            raise ValueError(f"weight_version must be a non-negative integer, got {self.weight_version!r}")


class RouterEndpoints:
    """The router's own endpoints (registry and status), one method per route, over one :class:`Router`."""

    def __init__(self, router: Router):
        self.router = router

    async def add_worker(self, request: Request):
        worker = await self.router.add_worker(_url_of(request, await _worker_request(request)))
        return {"worker": worker.to_json()}

    async def remove_worker(self, request: Request):
        return {"worker": self.router.registry.remove(_url_of(request, await _worker_request(request))).to_json()}

    async def set_worker_state(self, request: Request):
        body = await _worker_request(request)
        worker = await self.router.set_worker_state(_url_of(request, body), body.state,
                                                    parse_version(body.weight_version))
        return {"worker": worker.to_json()}

    async def list_workers(self):
        workers = self.router.workers_json()
        # "urls" is sglang-router's shape (miles/slime read it to reach every engine)
        return {"workers": workers, "urls": [w["url"] for w in workers]}

    async def health(self):
        workers = self.router.registry.workers()
        ready = sum(w.state is WorkerState.READY for w in workers)
        return JSONResponse(self.router.peers.health({"status": "ok", "num_workers": len(workers), "num_ready": ready}))

    async def metrics(self):
        return self.router.metrics()


class RouterApp(FastAPI):
    """The router's FastAPI app; generation requests go to ``fast_path`` (the guard, then
    :class:`~miles_disagg.router.fast_path.GenerationFastPath`) before any of FastAPI's own layers."""

    fast_path: GenerationFastPath | None = None
    guarded_fast_path: Any = None

    async def __call__(self, scope, receive, send) -> None:
        if self.fast_path is not None and self.fast_path.serves(scope):
            await self.guarded_fast_path(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def generation_methods() -> dict[str, frozenset[str]]:
    """The generation paths and the methods the fast path serves on each."""
    return {path: frozenset({"POST", "PUT"} if path == GENERATE_PATH else {"POST"})
            for path in (GENERATE_PATH, *OPENAI_PATHS)}


def create_app(config: RouterConfig, registry: WorkerRegistry | None = None, guard: ServerGuard | None = None, *,
               peers: Any = None, group: Any = None, server_id: str | None = None):
    """The router as an ASGI app; its lifespan starts and stops the health checker. ``guard``: keys
    and request limit (None: keys from the environment, the default limit). ``app.state.router``: the Router.

    A router of several processes: ``peers`` (a :class:`~miles_disagg.router.peers.LeaderPeers` over
    ``registry``), ``group`` (its other processes: ``await group.start(router)`` once the first health pass
    is done, ``await group.stop()`` first at shutdown) and ``server_id`` (the id every process answers with)."""
    guard = guard if guard is not None else ServerGuard.from_env()
    router = Router(config, registry, guard.keys, peers=peers)
    app = server_app("miles-disagg router", app_class=RouterApp, lifespan=_lifespan(router, group))
    install_guard(app, guard, server_id)
    methods = generation_methods()
    app.fast_path = GenerationFastPath(proxy=router.proxy, paths=methods)
    app.guarded_fast_path = GuardMiddleware(app.fast_path, guard=guard, server_id=app.state.server_id)
    router.server_id = app.state.server_id
    app.state.router = router
    for path, allowed in methods.items():  # served by the fast path; listed here for the schema and 405s
        app.add_api_route(path, _proxy_route(router, path), methods=sorted(allowed))
    endpoints = RouterEndpoints(router)
    for path, handler in (("/add_worker", endpoints.add_worker), ("/remove_worker", endpoints.remove_worker),
                          ("/set_worker_state", endpoints.set_worker_state)):
        app.add_api_route(path, _admin_errors(handler), methods=["POST"])
    for path, handler in (("/list_workers", endpoints.list_workers), ("/health", endpoints.health),
                          ("/metrics", endpoints.metrics)):
        app.add_api_route(path, handler, methods=["GET"])
    return app


def _lifespan(router: Router, group: Any = None):
    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await router.start()
        try:
            if group is not None:
                await group.start(router)
            yield
        finally:
            if group is not None:
                await group.stop()
            await router.stop()
    return lifespan


def _admin_errors(handler: Callable[[Request], Awaitable[dict]]):
    """``handler`` with the registry's errors as JSON answers: 404 unknown worker, 409 version mismatch
    (with ``expected``/``actual``), 400 bad input, 409 any other refusal."""
    async def wrapped(request: Request):
        try:
            return await handler(request)
        except UnknownWorker as exc:
            return error_response(404, exc)
        except WorkerVersionMismatch as exc:
            return error_response(409, exc, expected=exc.expected, actual=exc.actual)
        except MilesDisaggError as exc:
            return error_response(400 if isinstance(exc, InvalidInput) else 409, exc)
    return wrapped


def _proxy_route(router: Router, path: str):
    async def route(request: Request):
        return await router.proxy(request, path)
    route.__name__ = f"proxy_{path.strip('/').replace('/', '_')}"
    return route


async def _worker_request(request: Any) -> WorkerRequest:
    return parse_body(WorkerRequest, await request.body())


def _url_of(request: Any, body: WorkerRequest) -> str:
    """The worker URL from ``?url=`` or the JSON body's ``url``."""
    url = request.query_params.get("url")
    url = body.url if url is None else url
    if url is None:
        raise InvalidInput("give the worker url as {'url': ...} or ?url=")
    return url
