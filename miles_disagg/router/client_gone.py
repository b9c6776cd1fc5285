"""The proxy's watch for a client that leaves: its upstream request is then cancelled, which closes the
connection to the engine, and the engine aborts the generation."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable

from miles_disagg.net.pooled_http import Reply

log = logging.getLogger(__name__)
DISCONNECT_RECHECK_S = 1.0
WATCH_AFTER_S = 0.5


class ClientGone(Exception):
    """The client disconnected before its upstream request was answered (the router answers 499)."""


async def unless_client_gone(request: Any, send: Awaitable[Reply]) -> Reply:
    """Await ``send``; if the client disconnects first, cancel it (closing the upstream
    connection, which makes the engine abort the request) and raise ``ClientGone``.

    ``send`` runs in the caller's task; once it has been waited on for :data:`WATCH_AFTER_S`, one watcher
    task cancels that task if the client leaves (or has left) while ``send`` is still awaited. Most
    requests are answered sooner and never start a watcher: a task per request was a twentieth of the
    router's CPU per request (py-spy); a client that leaves is noticed at most that much later."""
    task = asyncio.current_task()
    state: dict[str, Any] = {"sending": True, "gone": False, "watcher": None}

    async def watch() -> None:
        await _client_disconnected(request)
        if state["sending"]:  # the task is suspended inside ``send``: the cancel lands there
            state["gone"] = True
            task.cancel()

    def start_watching() -> None:
        if state["sending"]:
            state["watcher"] = asyncio.ensure_future(watch())

    timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, start_watching)
    try:
        return await send
    except asyncio.CancelledError:
        if not state["gone"]:
            raise
        task.uncancel()
        raise ClientGone() from None
    finally:
        state["sending"] = False
        timer.cancel()
        if state["watcher"] is not None:
            state["watcher"].cancel()


async def _client_disconnected(request: Any) -> None:
    """Returns when the client is gone (the body was read, so ``receive`` waits for that).

    Never returns if the server cannot tell: not watching is safer than a false abort.
    """
    try:
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_RECHECK_S)
    except Exception:
        log.exception("cannot watch for client disconnects")
        await asyncio.Event().wait()
