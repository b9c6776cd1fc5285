"""``--use-session-server`` with ``--custom-agent-function-path``: each sample is one session of the user's agent.

miles' contract (``miles.rollout.generate_hub.agentic_tool_call.generate``): per sample a session is
created, the agent is called as ``await run_agent(base_url=..., prompt=sample.prompt,
request_kwargs=..., metadata=sample.metadata)`` with its session's ``base_url`` (OpenAI routes under
``{base_url}/v1``) and the run's sampling parameters under OpenAI's names (``max_tokens``, ``seed``,
``temperature`` ...); whatever dict it returns is merged into the sample's metadata (a
``--custom-rm-path`` reward reads it there). The session then becomes one sample per branch of its
trajectory tree, token-exact (:func:`~miles_disagg.rollout.sessions.types.session_samples`; miles'
``--use-session-server v2`` list return; one sample for an agent that never rewrote its history), and is
deleted; each branch sample is scored and joins the prompt's group. An agent that raised
still gets the turns it made (miles does the same); a session that broke or never called the model is
dropped: :class:`SessionDropped` gives its group up (``lost_groups``), counted by reason in
``session_drops/<reason>``.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from miles_disagg.config.session_rules import check_matcher
from miles_disagg.net.auth import ApiKeys
from miles_disagg.rollout.generate import RequestLost
from miles_disagg.rollout.hooks import HookKind, load_hook
from miles_disagg.rollout.sessions.app import SessionServer
from miles_disagg.rollout.sessions.matchers import BUILT_IN, Matcher, checked
from miles_disagg.rollout.sessions.service import SessionService, SessionSettings
from miles_disagg.rollout.sessions.templates import checkpoint_template
from miles_disagg.rollout.sessions.tito import TitoRule
from miles_disagg.samples import Sample
from miles_disagg.types import InvalidInput

log = logging.getLogger(__name__)

AGENT_FUNCTION = HookKind("--custom-agent-function-path", (), True,
                          "async def run_agent(base_url, prompt, request_kwargs, metadata) -> dict | None",
                          keywords=("base_url", "prompt", "request_kwargs", "metadata"))
MATCHER_FUNCTION = HookKind("--session-message-matcher", ("stored", "replayed"), False,
                            "def matches(stored: dict, replayed: dict) -> bool")
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "sampling_seed": "seed"}


def load_matcher(selector: str) -> Matcher:
    """``--session-message-matcher``: a built-in (:mod:`.matchers`) or a trusted ``pkg.module.function``,
    held to its contract (``ConfigError`` naming the flag for one that cannot be imported)."""
    check_matcher(selector)
    matcher = BUILT_IN.get(selector) or load_hook(MATCHER_FUNCTION, selector)
    return checked(matcher, selector)


def load_agent_function(config):
    """``--custom-agent-function-path``, imported and its signature checked (``ConfigError`` naming the flag)."""
    return load_hook(AGENT_FUNCTION, config.custom_agent_function_path)


def rollout_hooks_of(config):
    """The run's rollout hooks; a session run's generate function is the endpoint's own (also when miles'
    ``agentic_tool_call.generate`` path names it), so that flag is not imported then."""
    import dataclasses

    from miles_disagg.rollout.hooks import load_rollout_hooks

    if config.use_session_server:
        config = dataclasses.replace(config, custom_generate_function_path=None)
    return load_rollout_hooks(config)


def _stream_client():
    """The client of streamed turns (``stream: true``), with the run's keys towards the router."""
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0), trust_env=False,
                             headers=ApiKeys.from_env().headers_for("/generate"))


class SessionDropped(RequestLost):
    """A session's trajectory cannot be trained on (it broke a check, or the agent never called the model)."""


def chat_request_kwargs(sampling_params: dict[str, Any]) -> dict[str, Any]:
    """The run's SGLang sampling parameters under OpenAI's names (miles' ``build_chat_request_kwargs``)."""
    out = {OPENAI_NAMES.get(key, key): value for key, value in sampling_params.items() if value not in (None, [])}
    return {k: v for k, v in out.items() if k in ("max_tokens", "seed", "temperature", "top_p", "top_k", "stop")}


class AgentRollout:
    """The session service, its endpoint, and the generate function that runs the agent per sample."""

    def __init__(self, config, hf_dir: str, tokenizer, client, router_url: str, version_bound, *,
                 run_id: str | None = None, host: str = "127.0.0.1"):
        self.agent = load_agent_function(config)
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        rule = TitoRule.make(config.tito_model, checkpoint_template(hf_dir, config.chat_template_path), encode,
                             tuple(config.tito_allowed_append_roles))
        defaults = {"temperature": config.rollout_temperature, "top_p": config.rollout_top_p,
                    "top_k": config.rollout_top_k}
        settings = SessionSettings(defaults, config.rollout_max_response_len, run_id=run_id)
        self.counters: Counter = Counter()
        self.service = SessionService(client, router_url, rule,
                                      lambda ids: tokenizer.decode(ids, skip_special_tokens=True), settings,
                                      version_bound, self.counters, load_matcher(config.session_message_matcher),
                                      stream_client=_stream_client())
        port = config.session_server_port[0] if config.session_server_port else 0
        self.server = SessionServer(self.service, ApiKeys.from_env(), host, port)

    async def start(self) -> str:
        return await self.server.start()

    async def close(self) -> None:
        await self.server.close()
        await self.service.stream_client.aclose()

    async def generate(self, args, sample: Sample, sampling_params: dict[str, Any]) -> list[Sample]:
        """The custom generate of a session run: one session of the agent becomes one sample per branch of
        its trajectory tree (one for an agent that never rewrote its history)."""
        state = self.service.create(sample.metadata, version_bound=args.engine.version_bound)
        returned = None
        try:
            returned = await self.agent(base_url=self.server.base_url(state.session_id), prompt=sample.prompt,
                                        request_kwargs=chat_request_kwargs(sampling_params),
                                        metadata=dict(sample.metadata))
        except Exception as exc:  # miles: the agent's failure is logged; the turns it made are still collected
            log.warning("session %s: the agent raised %s: %s", state.session_id, type(exc).__name__, exc)
            self.counters["agent_errors"] += 1
        try:
            samples = self.service.finish(state.session_id, sample)
        except InvalidInput as exc:
            reason = "broken" if state.broken else "no_turns"
            self.counters[f"session_drops/{reason}"] += 1
            raise SessionDropped(str(exc)) from None
        for each in samples:
            if isinstance(returned, dict):
                each.metadata.update(returned)
        return samples
