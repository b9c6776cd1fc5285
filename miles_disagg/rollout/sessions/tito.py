"""Tokens in, tokens out (miles' TITO): a turn's prompt is the session's stored token ids plus the tokens
of the messages appended since, never a re-tokenization of the whole conversation.

The appended messages' tokens come from the chat template by a diff (miles' rule): render a stand-in
``[user, assistant]`` exchange without and with the appended messages (the second with the generation
prompt); the appended tokens are what the second adds. Only non-assistant messages are ever appended
(the assistant's tokens are the engine's own, stored as generated), and only in the roles
``--tito-allowed-append-roles`` allows (``tool`` always). Each model family then merges the stored ids
with those tokens by its own rule (``--tito-model``):

* ``default``: plain concatenation;
* ``qwen3``: Qwen3's template closes every turn with ``<|im_end|>`` and a newline, the model stops at
  ``<|im_end|>``: the newline is added after a stored ``<|im_end|>``.

The history a client sends back is matched against the session's trajectory tree first
(:mod:`.tree`, with ``--session-message-matcher``): the appended messages are those beyond the deepest
node whose path matches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from miles_disagg.config.session_rules import check_append_roles, check_tito_model
from miles_disagg.rollout.sessions.templates import render
from miles_disagg.types import ConfigError, InvalidInput

_STAND_IN_USER = {"role": "user", "content": "dummy"}


class HistoryMismatch(InvalidInput):
    """The messages a client sent append nothing to a path of the session's history."""


class AppendRoleRefused(InvalidInput):
    """A message appended after the assistant's turn has a role ``--tito-allowed-append-roles`` leaves out."""


@dataclass(frozen=True)
class TitoRule:
    """One model family's merge rule over a chat template (``encode``: text -> ids, no special tokens added)."""

    model: str
    template: str
    encode: Callable[[str], list[int]]
    allowed_roles: frozenset[str]
    im_end_id: int | None = None
    newline_id: int | None = None

    @classmethod
    def make(cls, model: str, template: str, encode: Callable[[str], list[int]],
             allowed_roles: tuple[str, ...] = ("tool",)) -> "TitoRule":
        check_tito_model(model)
        check_append_roles(allowed_roles)
        ids = {}
        if model == "qwen3":
            ids = {"im_end_id": _single_id(encode, "<|im_end|>"), "newline_id": _single_id(encode, "\n")}
        return cls(model, template, encode, frozenset(allowed_roles) | {"tool"}, **ids)

    def first_prompt(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A session's first prompt: the whole conversation rendered with the generation prompt."""
        return self.encode(render(self.template, messages, tools=tools, add_generation_prompt=True))

    def appended_ids(self, appended: list[dict], tools: list[dict] | None) -> list[int]:
        """The tokens ``appended`` (non-assistant messages) add after an assistant turn, generation prompt included."""
        for message in appended:
            if message.get("role") not in self.allowed_roles:
                raise AppendRoleRefused(f"a {message.get('role')!r} message after the assistant's turn: "
                                        f"--tito-allowed-append-roles allows {sorted(self.allowed_roles)}")
        base = [_STAND_IN_USER, _stand_in_assistant(appended)]
        without = render(self.template, base, tools=tools, add_generation_prompt=False)
        with_appended = render(self.template, base + list(appended), tools=tools, add_generation_prompt=True)
        if not with_appended.startswith(without):
            raise InvalidInput("the chat template does not render appended messages after the earlier ones "
                               "(it is not append-only); a TITO session cannot use it")
        return self.encode(with_appended[len(without):])

    def merge(self, stored: list[int], appended_ids: list[int]) -> list[int]:
        """The next turn's prompt: the stored ids, the family's boundary fix, the appended tokens."""
        prefix = list(stored)
        if self.model == "qwen3" and prefix and prefix[-1] == self.im_end_id:
            prefix.append(self.newline_id)
        return prefix + list(appended_ids)


def _single_id(encode: Callable[[str], list[int]], text: str) -> int:
    ids = encode(text)
    if len(ids) != 1:
        raise ConfigError(f"--tito-model qwen3: the tokenizer encodes {text!r} as {ids}, not one token (not a "
                          "ChatML tokenizer)", ("--tito-model",))
    return ids[0]


def _stand_in_assistant(appended: list[dict]) -> dict:
    """An assistant turn whose tool calls match the appended tool answers (templates check that)."""
    calls = [{"id": m.get("tool_call_id") or f"call_{i}", "type": "function",
              "function": {"name": m.get("name") or "tool", "arguments": "{}"}}
             for i, m in enumerate(appended) if m.get("role") == "tool"]
    return {"role": "assistant", "content": "", **({"tool_calls": calls} if calls else {})}
