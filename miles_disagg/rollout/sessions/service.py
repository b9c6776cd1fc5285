"""The session service: live sessions and their turns, each turn one ``/generate`` through the router.

Contracts:

* **Token-exact.** A turn's prompt is built by the TITO rule (:mod:`.tito`) from the stored ids and the
  appended messages only, checked to extend the stored ids, and sent as ``input_ids``; the engine's
  answer must report exactly that many prompt tokens; its output ids and logprobs are stored as they
  came, never re-tokenized. A failed check breaks the session (:class:`~.types.PrefixMismatch`, counted
  in ``prefix_mismatches``); a broken session takes no more turns and yields no sample.
* **Routing.** Every turn carries ``X-SMG-Routing-Key: <session id>`` (the router keeps the session on
  one engine, :mod:`miles_disagg.router.affinity`) and the rollout's version constraint in force at that
  moment (the same bound as every rollout request); refusals are retried as every rollout request is.
* **Concurrency.** One event loop; a session's turns are serialized by its lock (a second request for
  the same session waits for the first), so turns of one session never interleave.
* **Bounds.** At most :data:`~.types.MAX_SESSIONS` live sessions and :data:`~.types.MAX_TURNS` turns each.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from miles_disagg.rollout.generate import GenerationFailed, constrained, generate_one
from miles_disagg.rollout.sessions.chat import assistant_message, completion_json, parse_chat_request
from miles_disagg.rollout.sessions.tito import TitoRule, split_history
from miles_disagg.rollout.sessions.types import (MAX_SESSIONS, PrefixMismatch, SessionNotFound, SessionState, Turn,
                                                 session_sample)
from miles_disagg.router.affinity import ROUTING_KEY_HEADER
from miles_disagg.samples import Sample
from miles_disagg.types import InvalidInput, Retryable

VersionBound = Callable[[], "tuple[int | None, int | None]"]


class TooManySessions(Retryable):
    """Every session slot is taken; finish or delete one first."""


class _RoutedPost:
    """The rollout's HTTP client with the session's routing key on every request."""

    def __init__(self, client, headers: dict[str, str]):
        self._client, self._headers = client, headers

    async def post(self, url: str, json: Any):
        return await self._client.post(url, json=json, headers=self._headers)


@dataclass
class SessionSettings:
    """What every turn of every session gets."""

    sampling: dict[str, Any]
    """The run's SGLang ``sampling_params`` (a request's own values win)."""
    max_new_tokens: int
    """Most tokens one turn may generate (``--rollout-max-response-len``)."""
    model_name: str = "policy"
    run_id: str | None = None
    routing_key: bool = True
    """Send ``X-SMG-Routing-Key`` (session affinity); off only to measure what affinity buys (``bench agentic``)."""


class SessionService:
    """Live sessions on one event loop (see the module docstring)."""

    def __init__(self, client, router_url: str, rule: TitoRule, decode: Callable[[list[int]], str],
                 settings: SessionSettings, version_bound: VersionBound, counters: Counter | None = None):
        self._client, self._url, self.rule, self._decode = client, router_url, rule, decode
        self.settings, self.version_bound = settings, version_bound
        self.counters: Counter = counters if counters is not None else Counter()
        self.sessions: dict[str, SessionState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._bounds: dict[str, VersionBound] = {}

    # ------------------------------------------------------------------ lifecycle

    def create(self, metadata: dict | None = None, version_bound: VersionBound | None = None) -> SessionState:
        """A new session; ``version_bound``: the constraint its turns ask for (default: the service's, the
        training bound; an evaluation's sessions ask for exactly its version)."""
        if len(self.sessions) >= MAX_SESSIONS:
            raise TooManySessions(f"{MAX_SESSIONS} sessions are live; finish or delete one first")
        state = SessionState(secrets.token_urlsafe(18), dict(metadata or {}))
        self.sessions[state.session_id] = state
        self._locks[state.session_id] = asyncio.Lock()
        self._bounds[state.session_id] = version_bound or self.version_bound
        self.counters["sessions_created"] += 1
        return state

    def get(self, session_id: str) -> SessionState:
        state = self.sessions.get(session_id)
        if state is None:
            raise SessionNotFound(f"no live session {session_id[:64]!r}")
        return state

    def delete(self, session_id: str) -> SessionState:
        state = self.get(session_id)
        del self.sessions[session_id]
        self._locks.pop(session_id, None)
        self._bounds.pop(session_id, None)
        return state

    def finish(self, session_id: str, base: Sample) -> Sample:
        """The session as one training sample (``InvalidInput`` if it broke or never ran); it is deleted."""
        state = self.delete(session_id)
        sample = session_sample(state, base)
        self.counters["sessions_finished"] += 1
        return sample

    # ------------------------------------------------------------------ turns

    async def chat(self, session_id: str, body: dict) -> dict:
        """One OpenAI chat completion of the session (the answer as JSON)."""
        state = self.get(session_id)
        request = parse_chat_request(body)
        async with self._locks[session_id]:
            state.check_usable()
            messages = [m.to_dict() for m in request.messages]
            appended, prompt = self._prompt(state, messages, request.tools)
            try:
                state.check_prefix(prompt)
            except PrefixMismatch as exc:
                self._break(state, exc)
                raise
            params = request.sampling_params(self.settings.sampling, self.settings.max_new_tokens)
            payload = await self._generate(session_id, prompt, params)
            turn = self._turn(state, prompt, payload)
            message, tool_finish = assistant_message(self._decode(list(turn.output_ids)))
            state.record(turn, message, appended)
            self.counters["turns"] += 1
            self.counters["cached_tokens"] += turn.cached_tokens
            self.counters["prompt_tokens"] += len(prompt)
        finish = tool_finish or ("length" if turn.finish_reason == "length" else "stop")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(turn.output_ids),
                 "total_tokens": len(prompt) + len(turn.output_ids),
                 "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}
        meta = {"weight_version_start": turn.version_start, "weight_version_end": turn.version_end,
                "routed_worker": turn.worker, "turn": len(state.turns)}
        return completion_json(session_id, message, finish, usage, meta, request.model or self.settings.model_name)

    def _prompt(self, state: SessionState, messages: list[dict], tools) -> tuple[list[dict], list[int]]:
        if not state.turns:
            return messages, self.rule.first_prompt(messages, tools)
        try:
            appended = split_history(state.messages, messages)
        except InvalidInput:
            self.counters["history_mismatches"] += 1
            raise
        if any(m["role"] == "assistant" for m in appended):
            raise InvalidInput("an appended message has role 'assistant': a session's assistant turns are the "
                               "engine's own (a client cannot write them)")
        return appended, self.rule.merge(state.token_ids, self.rule.appended_ids(appended, tools))

    async def _generate(self, session_id: str, prompt: list[int], params: dict) -> dict:
        min_version, exact_version = self._bounds.get(session_id, self.version_bound)()
        body = constrained({"input_ids": prompt, "sampling_params": params, "return_logprob": True},
                           min_version, exact_version, self.settings.run_id)
        self.counters["requests"] += 1
        client = _RoutedPost(self._client, {ROUTING_KEY_HEADER: session_id} if self.settings.routing_key else {})
        payload = await generate_one(client, self._url, body, self.counters)
        if not isinstance(payload, dict):
            raise GenerationFailed(f"one prompt was sent, the router answered {type(payload).__name__}")
        return payload

    def _turn(self, state: SessionState, prompt: list[int], payload: dict) -> Turn:
        meta = payload.get("meta_info") or {}
        if meta.get("prompt_tokens") != len(prompt):
            exc = PrefixMismatch(state.session_id, len(prompt), f"the engine reports {meta.get('prompt_tokens')} "
                                                                 f"prompt tokens, {len(prompt)} were sent")
            self._break(state, exc)
            raise exc
        triples = meta.get("output_token_logprobs") or []
        output_ids = list(payload.get("output_ids") or [t[1] for t in triples])
        if [t[1] for t in triples] != output_ids:
            raise GenerationFailed(f"session {state.session_id}: the engine's logprobs do not match its output ids")
        finish = meta.get("finish_reason") or {}
        start, end = meta.get("weight_version_start"), meta.get("weight_version_end")
        if not (isinstance(start, int) and isinstance(end, int)):
            raise GenerationFailed(f"the serving engine reported no numeric weight version ({start!r}, {end!r})")
        return Turn(tuple(prompt), tuple(output_ids), tuple(float(t[0]) for t in triples), start, end,
                    finish.get("type", "length") if isinstance(finish, dict) else str(finish),
                    int(meta.get("cached_tokens") or 0), meta.get("routed_worker"))

    def _break(self, state: SessionState, exc: PrefixMismatch) -> None:
        state.broken = str(exc)
        self.counters["prefix_mismatches"] += 1
