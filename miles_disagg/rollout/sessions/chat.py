"""OpenAI chat completions over a session: the request body, the engine's sampling parameters, tool calls
parsed out of the completion (Qwen3's ``<tool_call>`` JSON), and the answer (streamed: :mod:`.streaming`).

Request bodies are validated strictly and bounded (messages, their size and nesting, tools); fields
that change what is sampled and that this endpoint does not implement (``n`` > 1, ``logit_bias``,
``response_format`` ...) are refused with 400 naming the field, never ignored.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_MESSAGES = 1024
MAX_CONTENT_CHARS = 1 << 20
MAX_TOOLS = 128
TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
UNSUPPORTED = {"n": (None, 1), "logit_bias": (None, {}), "response_format": (None, {"type": "text"}),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logprobs": (None, False)}


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = Field(default=None, max_length=MAX_CONTENT_CHARS)
    reasoning_content: str | None = Field(default=None, max_length=MAX_CONTENT_CHARS)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, max_length=64)
    tool_call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.reasoning_content:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(BaseModel):
    """The fields of OpenAI's chat completion request this endpoint acts on (others are ignored)."""

    model_config = ConfigDict(extra="ignore")

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    model: str | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=MAX_TOOLS)
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None

    def sampling_params(self, defaults: dict[str, Any], left: int) -> dict[str, Any]:
        """SGLang ``sampling_params`` for this turn: the run's defaults, the request's own values, and
        ``max_new_tokens`` capped by ``left`` (what the session's budget still allows)."""
        params = dict(defaults)
        wanted = self.max_completion_tokens or self.max_tokens or params.get("max_new_tokens") or left
        params["max_new_tokens"] = max(1, min(int(wanted), left))
        for ours, theirs in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                             ("sampling_seed", self.seed)):
            if theirs is not None:
                params[ours] = theirs
        if self.stop is not None:
            params["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        return params


def parse_chat_request(body: dict) -> ChatRequest:
    """``InvalidInput`` naming the field for a malformed or unsupported body."""
    from miles_disagg.net.httpjson import parse_body
    from miles_disagg.types import InvalidInput

    for name, allowed in UNSUPPORTED.items():
        if body.get(name) not in allowed:
            raise InvalidInput(f"{name}={body.get(name)!r} is not supported by the session endpoint")
    return parse_body(ChatRequest, body)


def assistant_message(text: str) -> tuple[dict[str, Any], str]:
    """The assistant message a completion's text is (content and parsed tool calls) and its
    ``finish_reason`` contribution (``tool_calls`` when it called any)."""
    calls = []
    for index, match in enumerate(TOOL_CALL.finditer(text)):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue  # not a well-formed call: it stays text
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        calls.append({"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
    content = text[:text.index("<tool_call>")].rstrip("\n") if calls else text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, "tool_calls" if calls else ""


def completion_json(session_id: str, message: dict, finish: str, usage: dict, meta: dict, model: str) -> dict:
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage, "metadata": {"session_id": session_id, **meta}}
