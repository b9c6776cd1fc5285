"""The session service: live sessions and their turns, each turn one ``/generate`` through the router.

Contracts:

* **A tree.** A request attaches to the deepest node of the session's trajectory tree whose path of
  messages it replays (:mod:`.tree`, matched by ``--session-message-matcher``); a rewritten or retried
  history starts a branch there (counted in ``branches``), and each branch becomes one sample.
* **Token-exact.** A turn's prompt is built by the TITO rule (:mod:`.tito`) from the attach node's ids and
  the appended messages only, checked to extend those ids, and sent as ``input_ids``; the engine's
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
from miles_disagg.rollout.sessions.chat import ChatRequest, assistant_message, completion_json, parse_chat_request
from miles_disagg.rollout.sessions.matchers import Matcher, strict
from miles_disagg.rollout.sessions.tito import HistoryMismatch, TitoRule
from miles_disagg.rollout.sessions.tree import AttachPoint, find_attach
from miles_disagg.rollout.sessions.types import (MAX_SESSIONS, PrefixMismatch, SessionNotFound, SessionState, Turn,
                                                 session_samples)
from miles_disagg.router.affinity import ROUTING_KEY_HEADER
from miles_disagg.samples import Sample
from miles_disagg.types import Retryable

VersionBound = Callable[[], "tuple[int | None, int | None]"]


class TooManySessions(Retryable):
    """Every session slot is taken; finish or delete one first."""


class _RoutedPost:
    """The rollout's HTTP client with the session's routing key on every request."""

    def __init__(self, client, headers: dict[str, str]):
        self._client, self._headers = client, headers

    async def post(self, url: str, json: Any):
        return await self._client.post(url, json=json, headers=self._headers)


@dataclass(frozen=True)
class TurnPlan:
    """One turn between :meth:`SessionService.plan_turn` and :meth:`SessionService.complete_turn`."""

    state: SessionState
    request: ChatRequest
    appended: list[dict]
    point: AttachPoint
    root: bool
    prompt: list[int]
    params: dict[str, Any]
    body: dict[str, Any]
    """The ``/generate`` body: ``input_ids``, ``sampling_params``, logprobs, the version constraint."""


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
                 settings: SessionSettings, version_bound: VersionBound, counters: Counter | None = None,
                 matches: Matcher = strict, stream_client=None):
        self.matches = matches
        self.stream_client = stream_client
        """An ``httpx.AsyncClient`` with the run's keys for streamed turns (``stream: true``; none: refused)."""
        self.router_url = router_url
        self._client, self._url, self.rule, self.decode = client, router_url, rule, decode
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

    def finish(self, session_id: str, base: Sample) -> list[Sample]:
        """The session as training samples, one per branch (``InvalidInput`` if it broke or never ran); it is deleted."""
        state = self.delete(session_id)
        samples = session_samples(state, base)
        self.counters["sessions_finished"] += 1
        self.counters["session_samples"] += len(samples)
        return samples

    # ------------------------------------------------------------------ turns

    async def chat(self, session_id: str, body: dict) -> dict:
        """One OpenAI chat completion of the session (the answer as JSON)."""
        state = self.get(session_id)
        request = parse_chat_request(body)
        async with self._locks[session_id]:
            plan = self.plan_turn(state, request)
            payload = await self._generate(session_id, plan.body)
            return self.complete_turn(plan, payload)

    def lock(self, session_id: str) -> asyncio.Lock:
        """The lock that serializes the session's turns (held from :meth:`plan_turn` to :meth:`complete_turn`)."""
        self.get(session_id)
        return self._locks[session_id]

    def plan_turn(self, state: SessionState, request: ChatRequest) -> TurnPlan:
        """The turn's prompt, where it attaches, its sampling parameters and its ``/generate`` body (with the
        session's version constraint now), checked (``PrefixMismatch`` breaks the session). Under the lock."""
        state.check_usable()
        messages = [m.to_dict() for m in request.messages]
        point, root, prompt = self._prompt(state, messages, request.tools)
        try:
            if not root:
                state.check_prefix(prompt, point.node)
        except PrefixMismatch as exc:
            self._break(state, exc)
            raise
        params = request.sampling_params(self.settings.sampling, self.settings.max_new_tokens)
        min_version, exact_version = self._bounds.get(state.session_id, self.version_bound)()
        body = constrained({"input_ids": prompt, "sampling_params": params, "return_logprob": True},
                           min_version, exact_version, self.settings.run_id)
        return TurnPlan(state, request, messages[point.matched:], point, root, prompt, params, body)

    def complete_turn(self, plan: TurnPlan, payload: dict) -> dict:
        """The engine's answer recorded as the turn (checked token-exact); the OpenAI completion. Under the lock."""
        state, prompt = plan.state, plan.prompt
        turn = self._turn(state, prompt, payload)
        message, tool_finish = assistant_message(self.decode(list(turn.output_ids)))
        state.record(turn, message, plan.appended, plan.point.node, root=plan.root)
        self.counters["turns"] += 1
        self.counters["cached_tokens"] += turn.cached_tokens
        self.counters["prompt_tokens"] += len(prompt)
        finish = tool_finish or ("length" if turn.finish_reason == "length" else "stop")
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(turn.output_ids),
                 "total_tokens": len(prompt) + len(turn.output_ids),
                 "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}
        meta = {"weight_version_start": turn.version_start, "weight_version_end": turn.version_end,
                "routed_worker": turn.worker, "turn": len(state.turns)}
        return completion_json(state.session_id, message, finish, usage, meta,
                               plan.request.model or self.settings.model_name)

    def headers_for(self, session_id: str) -> dict[str, str]:
        """The routing key every turn of the session carries (none when affinity is off)."""
        return {ROUTING_KEY_HEADER: session_id} if self.settings.routing_key else {}

    def _prompt(self, state: SessionState, messages: list[dict], tools) -> tuple[AttachPoint, bool, list[int]]:
        """Where the request attaches in the tree, whether it starts a new root, and the turn's prompt: the
        attach node's ids merged with the appended messages' tokens, or for a new root (nothing matches, or
        the client wrote an assistant message beyond the match) the whole conversation rendered."""
        point = find_attach(state.nodes, messages, self.matches)
        appended = messages[point.matched:]
        if not appended:
            self.counters["history_mismatches"] += 1
            raise HistoryMismatch(f"the request's {len(messages)} messages are all in the session already: a turn "
                                  "must append at least one message to a path of the session's history")
        root = point.node is None or any(m["role"] == "assistant" for m in appended)
        if state.nodes and (root or any(n.parent == point.node.seq for n in state.nodes)):
            self.counters["branches"] += 1
        if root:
            return AttachPoint(None, 0), True, self.rule.first_prompt(messages, tools)
        return point, False, self.rule.merge(point.node.token_ids, self.rule.appended_ids(appended, tools))

    async def _generate(self, session_id: str, body: dict) -> dict:
        self.counters["requests"] += 1
        payload = await generate_one(_RoutedPost(self._client, self.headers_for(session_id)), self._url, body,
                                     self.counters)
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
