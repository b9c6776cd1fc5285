"""The router's relay of a streamed ``/generate`` (``"stream": true``): the engine's SSE events as they come.

SGLang's ``/generate`` streams one ``data: {json}`` event per step (the answer so far: ``text``,
``output_ids``, ``meta_info``) and then ``data: [DONE]``. :class:`StreamRelay` opens that stream on the
worker the router chose and hands each event on as it arrives, with the same served-version keys the
router adds to a whole answer (``meta_info.weight_version_start`` / ``_end``, ``routed_worker``).

Contracts:

* Before the client gets a byte the first event is read: a worker that answers non-2xx, or whose first
  event shows it serving a version the request's constraint refuses, is answered as a whole request would
  be (its status relayed, or the router's 409), so a refused stream can be retried like any request.
* After that the stream is the client's: a worker that fails mid-stream ends it with one
  ``data: {"error": {...}}`` event (the worker is reported failed); a client that leaves closes the
  upstream stream, so the engine aborts the request. The worker counts as outstanding until the stream ends.
* Connection failures are typed as the whole-answer client types them (``NotConnected``,
  ``ConnectTimedOut``: nothing was sent, another worker may be tried; ``TransportFailed``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from miles_disagg.net.pooled_http import ConnectTimedOut, NotConnected, TransportFailed
from miles_disagg.router.policy import annotate_served_versions, version_served, violates
from miles_disagg.router.registry import parse_version

DONE = b"data: [DONE]"


@dataclass
class StreamCallbacks:
    """What the relay reports back to the router (its own bookkeeping stays there)."""

    annotate: Callable[[dict], str | None]
    """Add the served-version keys to one event's ``meta_info``; a refusal message if it breaks the constraint."""
    failed: Callable[[str], None]
    """The worker failed mid-stream (the reason)."""
    ended: Callable[[], None]
    """The stream ended, however it ended (the worker is no longer outstanding)."""


class StreamRelay:
    """Streams ``POST`` answers from workers (its own HTTP client: the proxy's reads whole answers)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float | None):
        import httpx

        self._client = httpx.AsyncClient(timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
                                         trust_env=False, limits=httpx.Limits(keepalive_expiry=4.0))

    async def aclose(self) -> None:
        await self._client.aclose()

    async def open(self, url: str, payload: bytes, headers: dict[str, str]):
        """The worker's streamed answer, its headers read (``NotConnected``/``ConnectTimedOut``/``TransportFailed``)."""
        import httpx

        request = self._client.build_request("POST", url, content=payload, headers=headers)
        try:
            return await self._client.send(request, stream=True)
        except httpx.ConnectTimeout as exc:
            raise ConnectTimedOut(f"connect to {url} timed out: {exc}") from None
        except httpx.ConnectError as exc:
            raise NotConnected(f"cannot connect to {url}: {exc}") from None
        except httpx.HTTPError as exc:
            raise TransportFailed(f"{type(exc).__name__}: {exc}") from None


async def first_event(upstream) -> tuple[AsyncIterator[str], bytes | None]:
    """The stream's lines and its first ``data:`` event (None: it ended first)."""
    lines = upstream.aiter_lines()
    async for line in lines:
        if line.startswith("data:"):
            return lines, line.encode()
    return lines, None


def annotated(event: bytes, annotate: Callable[[dict], str | None]) -> tuple[bytes, str | None]:
    """One ``data:`` event with served versions added (as is when not a JSON object); a refusal message."""
    if event.strip() == DONE:
        return event, None
    try:
        obj = json.loads(event[5:])
    except ValueError:
        return event, None
    if not isinstance(obj, dict) or "error" in obj:
        return event, None
    if not isinstance(obj.get("meta_info"), dict):
        obj["meta_info"] = {}
    refusal = annotate(obj["meta_info"])
    return b"data: " + json.dumps(obj).encode(), refusal


async def events(upstream, lines: AsyncIterator[str], first: bytes,
                 callbacks: StreamCallbacks) -> AsyncIterator[bytes]:
    """The client's SSE body: ``first``, then every later event annotated; an error event if the worker fails."""
    try:
        yield first + b"\n\n"
        async for line in lines:
            if not line.startswith("data:"):
                continue
            event, _ = annotated(line.encode(), callbacks.annotate)
            yield event + b"\n\n"
    except Exception as exc:  # the worker failed mid-stream: the client learns it in-band
        reason = f"the stream broke: {type(exc).__name__}: {exc}"
        callbacks.failed(reason)
        yield b"data: " + json.dumps({"error": {"message": reason, "type": "WorkerFailed", "code": 502,
                                                "retryable": True}}).encode() + b"\n\n"
    finally:
        await upstream.aclose()
        callbacks.ended()


def streaming_response(body: AsyncIterator[bytes], worker_url: str) -> Any:
    from fastapi.responses import StreamingResponse

    return StreamingResponse(body, media_type="text/event-stream",
                             headers={"X-Routed-Worker": worker_url, "Cache-Control": "no-cache"})


async def dispatch_stream(relay: StreamRelay, router, worker, path: str, payload: bytes, headers: dict,
                          record, *, fail: Callable[[Any, str], None], refuse: Callable[[str], Any]) -> Any:
    """``router``'s streamed request sent to ``worker`` (see the module docstring): the client's streaming
    answer, a whole refusal, or ``None`` if the worker could not be reached (nothing was sent).
    ``fail(worker, reason)`` takes the worker out of routing; ``refuse(message)`` is the router's 409."""
    dispatch_version = version_served(worker, record.constraint)
    record.worker = worker.url
    router.registry.acquire(worker)
    router.peers.load_changed(worker)

    def ended(served: bool = True) -> None:
        router.registry.release(worker, served=served)
        router.peers.load_changed(worker)

    def annotate(meta: dict) -> str | None:
        router.peers.observe_version(worker, parse_version(meta.get("weight_version")))
        annotate_served_versions(meta, dispatch_version, worker)
        start, end = meta["weight_version_start"], meta["weight_version_end"]
        if violates(start, end, record.constraint, worker.run_id):
            return (f"worker {worker.url} served versions {(start, end)} (start, end), which do not satisfy "
                    f"{record.constraint.describe()} (the router's view of it was stale); retry")
        record.served = [(start, end)]
        return None

    try:
        upstream = await relay.open(f"{worker.url}{path}", payload, headers)
    except NotConnected as exc:
        ended(served=False)
        fail(worker, f"cannot connect: {exc}")
        return None
    except TransportFailed as exc:
        ended(served=False)
        fail(worker, f"{type(exc).__name__}: {exc}")
        return _whole(502, {"type": "WorkerFailed", "retryable": True, "message": str(exc), "worker": worker.url})
    if upstream.status_code != 200 or "text/event-stream" not in upstream.headers.get("content-type", ""):
        content = await upstream.aread()
        await upstream.aclose()
        ended(served=upstream.status_code < 500)
        if upstream.status_code >= 500:
            fail(worker, f"{path} answered {upstream.status_code}: {content[:500]!r}")
            return _whole(502, {"type": "WorkerFailed", "retryable": True, "worker": worker.url,
                                "message": f"{path} answered {upstream.status_code}"})
        from fastapi.responses import Response

        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"), headers={"X-Routed-Worker": worker.url})
    try:
        lines, first = await first_event(upstream)
    except Exception as exc:
        await upstream.aclose()
        ended(served=False)
        fail(worker, f"the stream broke before its first event: {type(exc).__name__}: {exc}")
        return _whole(502, {"type": "WorkerFailed", "retryable": True, "worker": worker.url, "message": str(exc)})
    first, refusal = annotated(first or DONE, annotate)
    if refusal is not None:
        await upstream.aclose()
        ended()
        router.counters["stale_view"] += 1
        return refuse(refusal)
    callbacks = StreamCallbacks(annotate, lambda reason: fail(worker, reason), ended)
    record.status = 200
    return streaming_response(events(upstream, lines, first, callbacks), worker.url)


def _whole(status: int, body: dict) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(body, status_code=status)
