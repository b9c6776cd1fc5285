"""The engine manager's control endpoint: how ``miles-disagg engines add|remove|list`` reach a running job.

The engine manager (a Ray actor on the driver's node) serves this small HTTP API in a thread of its
own process, bound where the run's other servers bind (loopback unless the job spans nodes), and
writes its address to ``control.json`` in the run directory (removed when the run stops). The
run's admin key goes to ``control.key`` beside it, readable by the run's user only, so a CLI with
the run directory needs no other secret (``--admin-api-key`` or ``$MILES_DISAGG_ADMIN_API_KEY``
take precedence).

Endpoints (every one but ``/health`` takes the admin key: ``Authorization: Bearer <key>``; bodies
at most :data:`MAX_BODY_BYTES`; errors are JSON with a ``message``, nothing changed):

* ``GET /engines``: ``{"version", "engines": [{engine, url, kind, version, state, node, ...}]}``
* ``POST /engines/add`` ``{"urls": [...]}`` or ``{"managed": N}``: ``{"joined": [...]}``
  (400: an address that does not answer or match the job; 409: a run that cannot change members)
* ``POST /engines/remove`` ``{"urls": [...], "force": false, "drain_timeout_s": 120}``:
  ``{"removed": [...]}`` (404: an address that is not an engine of the run; 409: the last engine)
"""

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_disagg.net.auth import ApiKeys, AuthLevel
from miles_disagg.types import InvalidInput, MilesDisaggError

if TYPE_CHECKING:
    from miles_disagg.fleet.membership import Membership

log = logging.getLogger(__name__)

CONTROL_FILENAME = "control.json"
KEY_FILENAME = "control.key"
MAX_BODY_BYTES = 64 * 1024
MAX_URLS = 1024
MAX_DRAIN_TIMEOUT_S = 3600.0


@dataclass
class AddRequest:
    urls: list[str] = field(default_factory=list)
    managed: int = 0

    def __post_init__(self) -> None:
        if bool(self.urls) == bool(self.managed):
            raise InvalidInput("give either urls (engines to attach) or managed (a count of engines to start)")
        _check_urls(self.urls)
        if self.managed < 0 or self.managed > MAX_URLS:
            raise InvalidInput(f"managed must be between 1 and {MAX_URLS}, got {self.managed}")


@dataclass
class RemoveRequest:
    urls: list[str] = field(default_factory=list)
    force: bool = False
    drain_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not self.urls:
            raise InvalidInput("urls: name at least one engine to remove")
        _check_urls(self.urls)
        if not 0 <= self.drain_timeout_s <= MAX_DRAIN_TIMEOUT_S:
            raise InvalidInput(f"drain_timeout_s must be between 0 and {MAX_DRAIN_TIMEOUT_S:g}, "
                               f"got {self.drain_timeout_s}")


def _check_urls(urls: list[str]) -> None:
    if len(urls) > MAX_URLS:
        raise InvalidInput(f"at most {MAX_URLS} urls at once, got {len(urls)}")
    for url in urls:
        if not url.strip() or len(url) > 2048 or any(c.isspace() or not c.isprintable() for c in url.strip()):
            raise InvalidInput(f"not an engine address: {url[:100]!r}")


class Unauthorized(InvalidInput):
    """The caller did not send the run's admin key."""


def control_app(membership: "Membership", keys: ApiKeys):
    """The endpoint as a FastAPI app (the project's guard bounds bodies and slow senders)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    from miles_disagg.fleet.members import MembershipRefused, UnknownEngine
    from miles_disagg.net.asgi_guard import ServerGuard, error_body, install_guard, server_app
    from miles_disagg.net.httpjson import parse_body, status_for

    # (no `from __future__ import annotations` in this module: FastAPI reads `Request` from the handlers)
    app = server_app("miles-disagg engine membership")
    install_guard(app, ServerGuard(keys, max_request_bytes=MAX_BODY_BYTES))

    def admin_only(request: Request) -> None:
        if keys.caller_level(AuthLevel.ADMIN, request.headers.get("authorization")) is None:
            raise Unauthorized(f"{request.url.path} needs the run's admin key (Authorization: Bearer <key>)")

    def answer(request: Request, body: bytes | None, action) -> Any:
        try:
            admin_only(request)
            return action(body)
        except MilesDisaggError as exc:
            status = status_for(exc, {Unauthorized: 401, UnknownEngine: 404, MembershipRefused: 409})
            return JSONResponse(error_body(status, type(exc).__name__, str(exc)), status_code=status)

    @app.get("/health")
    def health():
        return {"status": "ok"}

    @app.get("/engines")
    def engines(request: Request):
        return answer(request, None, lambda _body: {"version": membership.slots.version,
                                                     "engines": membership.list()})

    @app.post("/engines/add")
    async def add(request: Request):
        body = await request.body()
        return await _in_thread(answer, request, body, lambda raw: _add(membership, parse_body(AddRequest, raw)))

    @app.post("/engines/remove")
    async def remove(request: Request):
        body = await request.body()
        return await _in_thread(answer, request, body, lambda raw: _remove(membership, parse_body(RemoveRequest, raw)))

    return app


async def _in_thread(fn, *args):
    """A membership change blocks (catch-up, drain): off the event loop, so the server keeps answering."""
    import asyncio

    return await asyncio.to_thread(fn, *args)


def _add(membership: "Membership", request: AddRequest) -> dict:
    if request.managed:
        return {"joined": membership.add_managed(request.managed)}
    return {"joined": membership.add_attached(request.urls)}


def _remove(membership: "Membership", request: RemoveRequest) -> dict:
    return {"removed": membership.remove(request.urls, force=request.force, drain_timeout_s=request.drain_timeout_s)}


class ControlServer:
    """The endpoint in a daemon thread of the manager's process; ``stop`` ends it and removes its files."""

    def __init__(self, membership: "Membership", run_dir: str | Path, host: str):
        import uvicorn

        from miles_disagg.net.process import listen_socket

        self.run_dir = Path(run_dir)
        self.keys = ApiKeys.from_env()
        sock = listen_socket(host, 0, backlog=64)
        port = sock.getsockname()[1]
        self.url = f"http://{host}:{port}" if ":" not in host else f"http://[{host}]:{port}"
        self._server = uvicorn.Server(uvicorn.Config(control_app(membership, self.keys), log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="membership-control", daemon=True)
        self._thread.start()
        self._write_files()

    def _write_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.keys.admin_api_key:
            _write_private(self.run_dir / KEY_FILENAME, self.keys.admin_api_key + "\n")
        _write_private(self.run_dir / CONTROL_FILENAME, json.dumps({"url": self.url, "pid": os.getpid()}) + "\n")

    def stop(self) -> None:
        for name in (CONTROL_FILENAME, KEY_FILENAME):
            try:
                (self.run_dir / name).unlink()
            except FileNotFoundError:
                pass
        self._server.should_exit = True
        self._thread.join(timeout=10)


def _write_private(path: Path, text: str) -> None:
    """Written whole (a reader never sees half of it), readable by this user only."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as stream:
        stream.write(text)
    os.replace(temporary, path)
