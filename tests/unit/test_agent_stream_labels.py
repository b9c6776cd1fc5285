"""The agent's streamed ``/generate`` under adapter versions: every SSE event names the adapter
version its item ran on, whatever the chunking; ``[DONE]`` passes; an oversized event ends the stream."""

from __future__ import annotations

import asyncio
import json

from miles_disagg.engines.agent import adapters
from miles_disagg.engines.agent.adapters import AgentAdapters


def relabel(body: dict, chunks: list[bytes]) -> bytes:
    async def source():
        for chunk in chunks:
            yield chunk

    async def collect():
        return b"".join([part async for part in AgentAdapters.label_stream(body, source())])

    return asyncio.run(collect())


def events(raw: bytes) -> list:
    return [e[len(b"data: "):].decode() for e in raw.split(b"\n\n") if e]


def test_events_are_labelled_across_chunk_boundaries_and_by_batch_index() -> None:
    meta = {"weight_version": "9", "weight_version_start": "9", "weight_version_end": "9"}
    stream = b"".join(b"data: " + json.dumps({"index": i, "text": "x", "meta_info": dict(meta)}).encode() + b"\n\n"
                      for i in (0, 1)) + b"data: [DONE]\n\n"
    for size in (1, 7, len(stream)):
        raw = relabel({"lora_path": ["v1", "v3"]}, [stream[i:i + size] for i in range(0, len(stream), size)])
        *items, done = events(raw)
        assert done == "[DONE]"
        assert [json.loads(e)["meta_info"]["weight_version_start"] for e in items] == ["1", "3"]
        assert [json.loads(e)["meta_info"]["weight_version_end"] for e in items] == ["1", "3"]


def test_an_oversized_event_ends_the_stream_with_an_error(monkeypatch) -> None:
    monkeypatch.setattr(adapters, "MAX_EVENT_BYTES", 64)
    raw = relabel({"lora_path": "v1"}, [b"data: " + b"x" * 100])
    assert events(raw) == ['{"error": {"message": "a streamed event exceeded the agent\'s limit"}}']
