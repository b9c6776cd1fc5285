"""The session endpoint over HTTP, as an agent drives it: the official ``openai`` client (tools, a tool
turn, streaming) against a real built-in engine behind the router; token-exact trajectories over 1,000
sessions with tool turns against a recording engine; keys and bad bodies refused; a harness that
rewrites and retries history gets one token-exact sample per branch."""

from __future__ import annotations

import asyncio
import json
import random
import threading

import httpx
import pytest
from deadlines import scaled
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from engine_fixtures import engine  # noqa: F401  (fixture)
from router_fixtures import inprocess_router, serve_in_thread
from session_fixtures import session_endpoint
from miles_disagg.rollout.sessions.chat import assistant_message
from miles_disagg.rollout.sessions.types import token_drift
from miles_disagg.samples import Sample

pytestmark = pytest.mark.timeout(300)
ADMIN = "sessions-admin-key-0123456789"
TOOLS = [{"type": "function", "function": {"name": "count", "description": "the next digits",
                                           "parameters": {"type": "object", "properties": {}}}}]


def _create(url: str, **metadata) -> str:
    answer = httpx.post(f"{url}/sessions", json={"metadata": metadata}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert answer.status_code == 200, answer.text
    return answer.json()["base_url"]


def _exact(endpoint, session_id: str) -> list:
    state = endpoint.service.get(session_id)
    assert token_drift(state.turns) == 0 and state.broken is None
    last = state.turns[-1]
    assert state.token_ids == list(last.prompt_ids + last.output_ids)
    return state.turns


def test_an_openai_client_agent_runs_tool_turns_token_exact_on_one_engine(engine, tiny_qwen3_dir):  # noqa: F811
    import openai

    with inprocess_router(workers=(engine.url,)) as router, \
            session_endpoint(tiny_qwen3_dir, router.url, admin_key=ADMIN) as endpoint:
        base_url = _create(endpoint.url, task="count")
        session_id = base_url.rsplit("/", 1)[1]
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none-needed", max_retries=0)
        messages = [{"role": "system", "content": "Count."}, {"role": "user", "content": "345"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6)
        assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens >= 1
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_0", "content": "67"}]
        stream = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                stream=True)  # relayed by the router as the engine streams it
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")
        streamed = endpoint.service.get(session_id).turns[-1]
        assert text == assistant_message(endpoint.service.decode(list(streamed.output_ids)))[0]["content"]
        assert endpoint.service.counters["streamed_turns"] == 1
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "89"}]
        third = client.chat.completions.create(model="policy", messages=messages, max_tokens=6)
        assert third.choices[0].message.role == "assistant"
        turns = _exact(endpoint, session_id)
        assert len(turns) == 3 and len({t.worker for t in turns}) == 1
        assert all(t.cached_tokens >= len(before.prompt_ids) for before, t in zip(turns, turns[1:]))  # prefix cache
        info = httpx.get(base_url).json()
        assert [t["cached_tokens"] for t in info["turns"]] == [t.cached_tokens for t in turns]
        [sample] = endpoint.service.finish(session_id, Sample(prompt="345"))
        assert sample.tokens == list(turns[-1].prompt_ids + turns[-1].output_ids)
        assert sum(sample.loss_mask) == sum(len(t.output_ids) for t in turns)
        assert httpx.get(base_url).status_code == 404  # finished: gone


def _engine_app():
    """A SGLang-shaped engine's app with its probes: ``/health`` and ``/model_info`` at version 1."""
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    @app.get("/model_info")
    async def model_info():
        return {"weight_version": "1"}

    return app


def _recording_engine(received: list):
    """A SGLang-shaped engine that answers random digits and records every prompt it got."""
    app, rng = _engine_app(), random.Random(0)

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        received.append(list(body["input_ids"]))
        out = [rng.randrange(3, 13) for _ in range(rng.randrange(1, 5))]
        return {"text": "", "output_ids": out,
                "meta_info": {"prompt_tokens": len(body["input_ids"]), "weight_version": "1",
                              "finish_reason": {"type": "length"}, "output_token_logprobs": [[-0.5, t, None] for t in out],
                              "cached_tokens": 0}}

    return app


def test_a_thousand_sessions_with_tool_turns_are_token_exact(tiny_qwen3_dir):
    received: list[list[int]] = []
    with serve_in_thread(_recording_engine(received)) as fake, inprocess_router(workers=(fake,)) as router, \
            session_endpoint(tiny_qwen3_dir, router.url) as endpoint:
        service = endpoint.service

        async def one(index: int, slots: asyncio.Semaphore) -> str:
            async with slots:  # as many in flight as a rollout's concurrency would allow
                state = service.create({"index": index})
                messages = [{"role": "user", "content": str(index)}]
                for turn in range(2):
                    answer = await service.chat(state.session_id, {"messages": messages, "tools": TOOLS})
                    messages += [answer["choices"][0]["message"], {"role": "tool", "content": f"{index}-{turn}"}]
                return state.session_id

        async def all_sessions():
            slots = asyncio.Semaphore(32)
            return await asyncio.gather(*(one(i, slots) for i in range(1000)))

        ids = endpoint.call(all_sessions(), timeout=240)
        turns = [t for sid in ids for t in _exact(endpoint, sid)]
        assert sorted(map(tuple, received)) == sorted(t.prompt_ids for t in turns)  # what the engine got, exactly
        assert service.counters["prefix_mismatches"] == 0 and service.counters["turns"] == 2000


def test_keys_and_bad_bodies_are_refused_and_change_nothing(tiny_qwen3_dir):
    received: list[list[int]] = []
    with serve_in_thread(_recording_engine(received)) as fake, inprocess_router(workers=(fake,)) as router, \
            session_endpoint(tiny_qwen3_dir, router.url, admin_key=ADMIN) as endpoint:
        assert httpx.post(f"{endpoint.url}/sessions", json={}).status_code == 401
        assert httpx.get(f"{endpoint.url}/sessions").status_code == 401
        base_url = _create(endpoint.url)
        chat = f"{base_url}/v1/chat/completions"
        assert httpx.post(f"{endpoint.url}/sessions/nope/v1/chat/completions", json={}).status_code == 404
        for bad in (b"not json", b'{"messages": []}', b'{"messages": [{"role": "user", "content": "1"}], "n": 3}',
                    b"[" * 100_000):
            answer = httpx.post(chat, content=bad)
            assert answer.status_code == 400 and answer.json()["error"]["message"], bad[:20]
        assert httpx.post(chat, content=b"x" * (17 * 1024 * 1024)).status_code == 413
        messages = [{"role": "user", "content": "1"}]
        first = httpx.post(chat, json={"messages": messages}).json()
        nothing_new = httpx.post(chat, json={"messages": messages + [first["choices"][0]["message"]]})
        assert nothing_new.status_code == 400 and "append at least one" in nothing_new.json()["error"]["message"]
        assert len(received) == 1  # the refusals reached no engine
        assert httpx.delete(base_url).json()["deleted"] and httpx.delete(base_url).status_code == 404


def test_a_harness_that_rewrites_and_retries_history_gets_one_token_exact_sample_per_branch(tiny_qwen3_dir):
    received: list[list[int]] = []
    with serve_in_thread(_recording_engine(received)) as fake, inprocess_router(workers=(fake,)) as router, \
            session_endpoint(tiny_qwen3_dir, router.url, admin_key=ADMIN, matcher="loose_tool_call") as endpoint:
        base_url = _create(endpoint.url)
        chat = f"{base_url}/v1/chat/completions"
        session_id = base_url.rsplit("/", 1)[1]

        def turn(messages):
            answer = httpx.post(chat, json={"messages": messages, "tools": TOOLS})
            assert answer.status_code == 200, answer.text
            return answer.json()["choices"][0]["message"]

        start = [{"role": "user", "content": "1"}]
        a = turn(start)
        line = start + [a, {"role": "tool", "content": "2"}]
        b = turn(line)
        turn(line + [b, {"role": "tool", "content": "3"}])  # the main line: a, b, c
        turn(line)  # the latest turn retried: a sibling of b
        turn(start + [{**a, "content": "an edited answer"}, {"role": "user", "content": "4"}])  # rewritten: a new root
        turn([{"role": "user", "content": "another start"}])  # an unrelated start: a new root
        state = endpoint.service.get(session_id)
        assert [n.parent for n in state.nodes] == [None, 0, 1, 0, None, None]
        assert endpoint.service.counters["branches"] == 3
        assert httpx.get(base_url).json()["num_branches"] == 4
        samples = endpoint.service.finish(session_id, Sample(prompt="1"))
        assert len(samples) == 4
        by_prompt = {tuple(ids): ids for ids in received}
        for sample, leaf in zip(samples, (2, 3, 4, 5)):
            node = state.nodes[leaf]
            assert sample.tokens == node.token_ids  # the branch's tokens, exactly the engine's
            assert tuple(node.turn.prompt_ids) in by_prompt
            assert sample.metadata["session"]["branch"]["leaf"] == leaf
        trained = sum(sum(s.loss_mask) for s in samples)
        assert trained == sum(len(t.output_ids) for t in state.turns)  # every completion trained exactly once


def _gated_streaming_engine(output_ids: list[int], gate: threading.Event, held: list[bool]):
    """A SGLang-shaped engine that streams its first token, then holds the rest until ``gate`` is set (or a
    generous deadline passes: ``held`` records it), then the rest and the whole answer."""
    app = _engine_app()

    @app.post("/generate")
    async def generate(request: Request):
        body = await request.json()
        assert body["stream"] is True

        def event(n: int, finished: bool) -> str:
            meta = {"prompt_tokens": len(body["input_ids"]), "weight_version": "1", "cached_tokens": 0,
                    "finish_reason": {"type": "length"} if finished else None,
                    "output_token_logprobs": [[-0.25, t, None] for t in output_ids[:n]]}
            return f"data: {json.dumps({'text': '', 'output_ids': output_ids[:n], 'meta_info': meta})}\n\n"

        async def events():
            yield event(1, False)
            held.append(not await asyncio.to_thread(gate.wait, scaled(60)))
            for n in range(2, len(output_ids) + 1):
                yield event(n, False)
            yield event(len(output_ids), True)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_an_openai_client_stream_gets_chunks_before_the_turn_ends_and_the_turn_is_token_exact(tiny_qwen3_dir):
    import openai

    from miles_disagg.models.tokenizer import load_tokenizer

    output_ids = load_tokenizer(tiny_qwen3_dir)("Hello there, friend", add_special_tokens=False)["input_ids"]
    gate, held = threading.Event(), []
    with serve_in_thread(_gated_streaming_engine(output_ids, gate, held)) as fake, \
            inprocess_router(workers=(fake,)) as router, \
            session_endpoint(tiny_qwen3_dir, router.url, admin_key=ADMIN) as endpoint:
        base_url = _create(endpoint.url)
        session_id = base_url.rsplit("/", 1)[1]
        client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="none-needed", max_retries=0)
        stream = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}],
                                                stream=True)
        text, early = "", None
        for chunk in stream:
            delta = chunk.choices[0].delta.content if chunk.choices else None
            if delta and early is None:  # the engine holds the rest of its turn until this is seen
                early = (delta, len(endpoint.service.get(session_id).turns))
                gate.set()
            text += delta or ""
        assert held == [False]  # the first chunk reached the client while the engine still held the turn
        assert early[1] == 0 and early[0]  # ... and before the session recorded it
        turn = endpoint.service.get(session_id).turns[-1]
        assert list(turn.output_ids) == output_ids and turn.output_logprobs == (-0.25,) * len(output_ids)
        assert text == endpoint.service.decode(output_ids)
        [sample] = endpoint.service.finish(session_id, Sample(prompt="hi"))
        assert sample.tokens == list(turn.prompt_ids) + output_ids and sample.loss_mask == [1] * len(output_ids)
        assert sample.call_versions == [[1, 1]]
