"""A session turn with ``"stream": true``: OpenAI chunks as the engine generates, the turn token-exact.

The turn is planned as any turn (:meth:`~.service.SessionService.plan_turn`, under the session's lock)
and sent to the router's ``/generate`` with ``"stream": true``; the router relays the engine's SSE
events as they come (:mod:`miles_disagg.router.streams`). Each event carries the output ids so far:
they are decoded and what the text gained is sent as a ``content`` delta. Text that may turn out to be
a tool call (from ``<tool_call>``, or a prefix of it at the end) or trailing newlines before one, and
a partly decoded character, are held back, so the streamed content is always a prefix of the final
message's. The last event is the engine's whole answer: it is checked and recorded exactly as a
non-streamed turn's (:meth:`~.service.SessionService.complete_turn`), then the rest of the content, the
tool calls and the finish (with ``usage`` and the served versions) are sent, and ``[DONE]``.

Refusals before the stream starts (version not ready, no engine) are retried as every rollout request
is; a failure after it started ends the stream with a ``data: {"error": ...}`` event and records
nothing. A client that leaves closes the stream to the router (the engine aborts the request) and
records nothing. The session's lock is held until the stream ends.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, AsyncIterator

from miles_disagg.rollout.generate import MAX_ATTEMPTS, RETRYABLE_STATUS, GenerationFailed
from miles_disagg.rollout.sessions.chat import parse_chat_request
from miles_disagg.types import InvalidInput

TOOL_CALL_START = "<tool_call>"


class ContentDeltas:
    """What each new decoded text adds to the streamed content (see the module docstring)."""

    def __init__(self):
        self.sent = ""

    def next(self, text: str) -> str:
        visible = _visible(text)
        if not visible.startswith(self.sent) or len(visible) <= len(self.sent):
            return ""
        delta, self.sent = visible[len(self.sent):], visible
        return delta

    def rest(self, content: str) -> str:
        """The final content's part not sent yet (``content`` always starts with what was sent)."""
        if not content.startswith(self.sent):
            raise GenerationFailed("the streamed content is not a prefix of the turn's message")
        return content[len(self.sent):]


def _visible(text: str) -> str:
    cut = text.find(TOOL_CALL_START)
    if cut >= 0:
        return text[:cut].rstrip("\n")
    for size in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:size]):
            text = text[:-size]
            break
    text = text.rstrip("\ufffd")  # a character whose bytes are not all generated yet
    return text.rstrip("\n")


async def open_turn_stream(service, session_id: str, body: dict) -> AsyncIterator[bytes]:
    """The turn's SSE body (an async iterator of ``data:`` events), once the engine's stream has started;
    errors before that raise (typed as for a non-streamed turn)."""
    state = service.get(session_id)
    request = parse_chat_request(body)
    if service.stream_client is None:
        raise InvalidInput("stream=true is not served by this session endpoint (no streaming client); send "
                           "stream=false")
    lock = service.lock(session_id)
    await lock.acquire()
    try:
        plan = service.plan_turn(state, request)
        upstream = await _open(service, session_id, {**plan.body, "stream": True})
    except BaseException:
        lock.release()
        raise
    return _chunks(service, plan, upstream, lock)


async def _open(service, session_id: str, body: dict):
    """The router's streamed answer (status 200); refusals retried, others ``GenerationFailed``."""
    client, counters = service.stream_client, service.counters
    counters["requests"] += 1
    last = ""
    for attempt in range(1, MAX_ATTEMPTS + 1):
        request = client.build_request("POST", f"{service.router_url}/generate", json=body,
                                       headers=service.headers_for(session_id))
        try:
            response = await client.send(request, stream=True)
        except Exception as exc:  # the router unreachable for a moment: retried
            counters["retried"] += 1
            last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(min(2.0, 0.1 * attempt))
            continue
        if response.status_code == 200:
            return response
        text = (await response.aread()).decode(errors="replace")[:500]
        await response.aclose()
        if response.status_code not in RETRYABLE_STATUS:
            raise GenerationFailed(f"/generate answered {response.status_code}: {text}")
        counters["retried"] += 1
        last = text
        await asyncio.sleep(min(5.0, max(0.02, float(response.headers.get("retry-after", 0.2)))))
    raise GenerationFailed(f"/generate failed {MAX_ATTEMPTS} times; last: {last}")


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


async def _chunks(service, plan, upstream, lock: asyncio.Lock) -> AsyncIterator[bytes]:
    model = plan.request.model or service.settings.model_name
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": model}

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> bytes:
        return _event({**base, **extra, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    try:
        yield chunk({"role": "assistant", "content": ""})
        deltas, final = ContentDeltas(), None
        async for line in upstream.aiter_lines():
            data = line[5:].strip() if line.startswith("data:") else None
            if data is None or data == "[DONE]":
                continue
            event = json.loads(data)
            if "error" in event:
                raise GenerationFailed(f"the engine's stream failed: {json.dumps(event['error'])[:300]}")
            final = event
            delta = deltas.next(service.decode(list(event.get("output_ids") or [])))
            if delta:
                yield chunk({"content": delta})
        if final is None:
            raise GenerationFailed("the engine's stream ended without an answer")
        completion = service.complete_turn(plan, final)
        service.counters["streamed_turns"] += 1
        choice = completion["choices"][0]
        rest = deltas.rest(choice["message"].get("content") or "")
        if rest:
            yield chunk({"content": rest})
        for index, call in enumerate(choice["message"].get("tool_calls") or []):
            yield chunk({"tool_calls": [{"index": index, **call}]})
        yield chunk({}, choice["finish_reason"], usage=completion["usage"], metadata=completion["metadata"])
        yield b"data: [DONE]\n\n"
    except Exception as exc:  # after the stream started the client learns it in-band; nothing is recorded
        service.counters["stream_failures"] += 1
        yield _event({"error": {"message": str(exc), "type": type(exc).__name__, "code": 502,
                                "retryable": False}})
    finally:
        await upstream.aclose()
        lock.release()
