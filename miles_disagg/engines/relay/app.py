"""The relay's HTTP app: ``GET /objects/{key}`` (a version object's bytes; API key), ``GET /relay_info``
(what it pulled across the WAN, per version), ``GET /health`` (open).

An object key outside the store's versions (``LATEST``, another prefix, a climbing path) is 400;
an object the store does not have is 404; a store that does not answer is 503. Every answer of
``/objects`` carries :data:`~miles_disagg.weights.relay_client.RELAY_SOURCE_HEADER`: ``store`` when
this request's pull crossed the WAN, ``cache`` otherwise.
"""

# no "from __future__ import annotations": FastAPI must see the real Request class

from fastapi import Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import FileResponse, JSONResponse

from miles_disagg.engines.relay.cache import RelayCache
from miles_disagg.net.asgi_guard import ServerGuard, error_body, install_guard, server_app
from miles_disagg.types import InvalidInput, MilesDisaggError, Retryable
from miles_disagg.weights.relay_client import RELAY_SOURCE_HEADER


class ObjectResponse(FileResponse):
    """A cached object's bytes in 1 MiB reads (Starlette's 64 KiB cost a thread hop each: the relay
    serves every engine of its region the whole version)."""

    chunk_size = 1024 * 1024


def create_app(cache: RelayCache, region: str = "", guard: ServerGuard | None = None):
    app = server_app("miles-disagg relay")
    install_guard(app, guard)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/relay_info")
    async def relay_info():
        return {"store": cache.location.display, "region": region, **cache.stats()}

    @app.get("/objects/{key:path}")
    async def objects(key: str, request: Request):
        try:
            served = await run_in_threadpool(cache.get, key)
        except InvalidInput as exc:
            return JSONResponse(error_body(400, type(exc).__name__, str(exc)), status_code=400)
        except FileNotFoundError as exc:
            return JSONResponse(error_body(404, "NotFound", f"the store has no object {exc}"), status_code=404)
        except (Retryable, MilesDisaggError) as exc:
            return JSONResponse(error_body(503, type(exc).__name__, str(exc)), status_code=503)
        source = "store" if served.crossed_wan else "cache"
        return ObjectResponse(served.path, headers={RELAY_SOURCE_HEADER: source}, media_type="application/octet-stream")

    return app
