"""``/generate``'s request body as pydantic models, split into the items the engine generates.

Field names and defaults follow SGLang's ``io_struct.py`` (``GenerateReqInput`` and its
``sampling_params``); validation as in ``bodies.py`` (strict, ``InvalidInput`` naming the field,
unknown fields ignored, ``null`` the default). The control endpoints' bodies are in
``control_bodies.py``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Self

from pydantic import BeforeValidator, Field, ValidationInfo, model_validator

from miles_disagg.engines.builtin.bodies import Body, Ints, NonEmptyStr, TokenId, as_tuple
from miles_disagg.net.httpjson import parse_body, parse_json
from miles_disagg.types import InvalidInput

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_PROMPT_TOKENS = "max_prompt_tokens"  # validation context key: the server's context length


# SGLang sampling knobs this engine does not implement, with their no-op values. A client that
# sends the no-op value (as SGLang clients commonly do) is served; any other value is refused
# with 400 rather than silently sampling from a different distribution than the one asked for.
UNSUPPORTED_SAMPLING = {
    "n": 1, "min_new_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "logit_bias": None, "custom_params": None,
}

# Top-level ``/generate`` fields of SGLang this engine does not implement, with their no-op
# values (a list of no-op values, one per batch item, is accepted too).
UNSUPPORTED_GENERATE = {
    "return_hidden_states": (False,),
    "return_indexer_topk": (False,), "return_sampling_mask": (False,),
    "input_embeds": (), "image_data": (), "video_data": (), "audio_data": (),
}


def refuse_version_constraint(obj: Any) -> None:
    """``weight_version`` in a generation request is a router constraint: an engine serves whatever it
    holds, so taking the field silently would let a client believe its request was constrained."""
    if isinstance(obj, dict) and "weight_version" in obj:
        raise ValueError("weight_version: an engine serves the version it holds and ignores constraints; send "
                         "constrained requests to the router (or the rollout service), or drop the field")


class SamplingParams(Body):
    """SGLang's ``sampling_params`` subset (same names, same defaults); the knobs in
    ``UNSUPPORTED_SAMPLING`` are refused unless they carry their no-op value."""

    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=1e4)
    top_p: float = Field(1.0, ge=1e-9, le=1.0)
    top_k: int = Field(-1, ge=-1)  # -1 or 0: the whole vocabulary
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    stop: Annotated[tuple[NonEmptyStr, ...], BeforeValidator(lambda v: (v,) if isinstance(v, str) else as_tuple(v))] = ()
    stop_token_ids: Ints = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, obj: Any) -> Any:
        for name, noop in UNSUPPORTED_SAMPLING.items():
            value = obj.get(name) if isinstance(obj, dict) else None
            if value is not None and value != noop:
                raise ValueError(f"{name}={value!r} is not supported by the built-in engine (only {noop!r} or null)")
        return obj


class GenerateReqInput(Body):
    """SGLang's ``GenerateReqInput``: exactly one of ``text``/``input_ids``, each one prompt or a
    batch. ``sampling_params``, ``return_logprob``, ``top_logprobs_num``, ``logprob_start_len``
    (-1: no input logprobs) and ``rid`` are one value shared by the batch or a list with one entry
    per item (a string ``rid`` for a batch is a prefix: ``rid_0``, ``rid_1``, ...); they are
    validated split per item. ``token_ids_logprob`` (SGLang's: ids scored at every position, one
    list shared by the batch or one per item) and ``token_ids_logprob_positions`` (miles' patched
    SGLang's: one id list per input position from ``logprob_start_len`` on; a batch gives one such
    list per item) name the token ids whose logprobs are reported."""

    text: tuple[str, ...] | None = None
    input_ids: tuple[Annotated[Ints, Field(min_length=1)], ...] | None = None
    batched: bool = False
    sampling_params: tuple[SamplingParams, ...] = ()
    return_logprob: tuple[bool, ...] = ()
    top_logprobs_num: tuple[Annotated[int, Field(ge=0)], ...] = ()
    logprob_start_len: tuple[Annotated[int, Field(ge=-1)], ...] = ()
    rid: tuple[str, ...] = ()  # "": none given (a fresh one is made)
    return_routed_experts: bool = False
    routed_experts_start_len: tuple[Annotated[int, Field(ge=0)], ...] = ()
    token_ids_logprob: tuple[tuple[TokenId, ...] | None, ...] = ()
    token_ids_logprob_positions: tuple[tuple[tuple[TokenId, ...], ...] | None, ...] = ()
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: tuple[Annotated[str, Field(max_length=256)] | None, ...] = ()
    lora_path: tuple[Annotated[str, Field(min_length=1, max_length=256)] | None, ...] = ()
    """SGLang's: the loaded LoRA adapter (by its lora_name) each item runs with (None: the base)."""
    """SGLang's cache isolation key (one per item or shared): requests with different keys never
    share prefix-cache entries."""

    @model_validator(mode="before")
    @classmethod
    def _split_batch(cls, obj: Any, info: ValidationInfo) -> Any:
        refuse_version_constraint(obj)
        if not isinstance(obj, dict):
            return obj
        _refuse_unsupported_fields(obj)
        text, input_ids = obj.get("text"), obj.get("input_ids")
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        _refuse_overlong(input_ids, (info.context or {}).get(MAX_PROMPT_TOKENS))
        prompts, batched = _prompts(text, input_ids)
        count, rid = len(prompts), obj.get("rid")
        return {
            **obj, "text" if text is not None else "input_ids": prompts, "batched": batched,
            "sampling_params": _per_item(obj.get("sampling_params"), count, "sampling_params", {}),
            "return_logprob": _per_item(obj.get("return_logprob"), count, "return_logprob", False),
            "top_logprobs_num": _per_item(obj.get("top_logprobs_num"), count, "top_logprobs_num", 0),
            "logprob_start_len": _per_item(obj.get("logprob_start_len"), count, "logprob_start_len", -1),
            "routed_experts_start_len": _per_item(obj.get("routed_experts_start_len"), count,
                                                  "routed_experts_start_len", 0),
            "token_ids_logprob": _id_lists(obj.get("token_ids_logprob"), count, batched),
            "token_ids_logprob_positions": _position_lists(obj.get("token_ids_logprob_positions"), count, batched),
            "extra_key": _per_item(obj.get("extra_key"), count, "extra_key", None),
            "lora_path": _per_item(obj.get("lora_path"), count, "lora_path", None),
            "rid": (tuple(f"{rid}_{i}" for i in range(count)) if batched and isinstance(rid, str)
                    else _per_item(rid, count, "rid", "")),
        }

    @model_validator(mode="after")
    def _check(self) -> Self:
        given = [r for r in self.rid if r]
        if len(set(given)) != len(given):
            raise ValueError(f"rid values must be distinct within a request, got {list(self.rid)!r}")
        if self.stream and self.batched:
            raise ValueError("stream=true is supported for single requests only")
        return self


PRECHECK_BYTES = 1 << 20


def _precheck(body: bytes, max_prompt_tokens: int | None, max_total_tokens: int | None) -> None:
    if max_total_tokens is not None and b'"input_ids"' in body and body.count(b",") > max_total_tokens:
        raise InvalidInput(f"input_ids: more than {max_total_tokens} tokens in one request (what this server's "
                           "batch and context could ever hold)")
    try:
        _refuse_overlong(parse_json(body).get("input_ids"), max_prompt_tokens)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def _refuse_overlong(input_ids: Any, limit: int | None) -> None:
    """Before any per-token work: a prompt longer than the server's context is refused at once."""
    if limit is None or not isinstance(input_ids, list) or not input_ids:
        return
    prompts = input_ids if isinstance(input_ids[0], list) else [input_ids]
    longest = max((len(p) for p in prompts if isinstance(p, list)), default=0)
    if longest > limit:
        raise ValueError(f"input_ids holds a prompt of {longest} tokens, more than the context length {limit}")


def _refuse_unsupported_fields(obj: dict) -> None:
    for name, noops in UNSUPPORTED_GENERATE.items():
        value = obj.get(name)
        values = value if isinstance(value, list) and name != "input_embeds" else [value]
        if any(v is not None and v not in noops for v in values):
            raise ValueError(f"{name}={value!r} is not supported by the built-in engine")


def _prompts(text: Any, input_ids: Any) -> tuple[tuple, bool]:
    """(one prompt per item, batched)."""
    if text is not None:
        if isinstance(text, str):
            return (text,), False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return tuple(text), True
        raise ValueError("text must be a string or a non-empty list of strings")
    if not isinstance(input_ids, list) or not input_ids:
        raise ValueError("input_ids must be a non-empty list of ints or of lists of ints")
    if all(_is_int(t) for t in input_ids):
        return (tuple(input_ids),), False
    if all(isinstance(seq, list) and seq and all(_is_int(t) for t in seq) for seq in input_ids):
        return tuple(tuple(seq) for seq in input_ids), True
    raise ValueError("input_ids must be a non-empty list of ints or of non-empty lists of ints")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(_is_int(t) for t in value)


def _id_lists(value: Any, count: int, batched: bool) -> tuple:
    """SGLang's ``token_ids_logprob`` per item: none, one id list for every item, or (a batch) one list each."""
    if value is None or value == []:
        return (None,) * count
    if _is_ids(value):
        return (tuple(value),) * count
    if batched and isinstance(value, list) and len(value) == count and all(v is None or _is_ids(v) for v in value):
        return tuple(None if not v else tuple(v) for v in value)
    raise ValueError("token_ids_logprob must be a list of token ids (or, for a batch, one such list per item)")


def _position_lists(value: Any, count: int, batched: bool) -> tuple:
    """``token_ids_logprob_positions`` per item: one id list per scored input position (a batch: one such per item)."""
    def one(rows: Any) -> tuple | None:
        if rows is None:
            return None
        if not isinstance(rows, list) or not all(_is_ids(r) for r in rows):
            raise ValueError("token_ids_logprob_positions must hold one list of token ids per input position")
        return tuple(tuple(r) for r in rows)

    if value is None:
        return (None,) * count
    if not batched:
        return (one(value),)
    if not isinstance(value, list) or len(value) != count:
        raise ValueError(f"token_ids_logprob_positions of a batch of {count} needs one entry per item")
    return tuple(one(v) for v in value)


def _per_item(value: Any, count: int, name: str, default: Any) -> tuple:
    """SGLang lets a batch share one value or give one per item (``null``: the default)."""
    values = value if isinstance(value, list) else [value] * count
    if len(values) != count:
        raise ValueError(f"{name} has {len(values)} entries for a batch of {count}")
    return tuple(default if v is None else v for v in values)


@dataclass(frozen=True)
class GenerateItem:
    """One sequence to generate (a batched request is split into several)."""

    rid: str
    input_ids: tuple[int, ...] | None
    text: str | None
    sampling: SamplingParams
    return_logprob: bool
    return_text_in_logprobs: bool = False
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    logprob_start_len: int = -1
    """SGLang's: the first prompt position whose token gets an input logprob (-1: none); kept only
    with ``return_logprob`` (SGLang ignores it otherwise)."""
    token_ids_logprob: tuple[int, ...] | None = None
    """SGLang's: report these ids' logprobs at every scored input position and every output token."""
    token_ids_logprob_positions: tuple[tuple[int, ...], ...] | None = None
    """miles' patched SGLang's: input position ``logprob_start_len + j`` reports the ids of entry ``j``."""

    @property
    def wants_token_ids(self) -> bool:
        """Whether the answer carries ``input_token_ids_logprobs`` / ``output_token_ids_logprobs``."""
        return self.return_logprob and (self.token_ids_logprob is not None
                                        or self.token_ids_logprob_positions is not None)
    extra_key: str | None = None
    lora_path: str | None = None
    """SGLang's: the name of the loaded LoRA adapter this item runs with (None: the base)."""
    """SGLang's cache isolation key: the prefix-cache namespace this request reads and fills."""

    @property
    def wants_input_logprobs(self) -> bool:
        """Whether the prompt's tokens from ``logprob_start_len`` on are scored (a prefill that keeps
        those positions' logits; with ``max_new_tokens`` 0 a pure scoring call)."""
        return self.return_logprob and self.logprob_start_len >= 0


def check_logprob_start_len(item: GenerateItem, prompt_len: int) -> None:
    """SGLang refuses a ``logprob_start_len`` past the prompt's end (the tokenized prompt, so a
    ``text`` prompt is checked after tokenizing): ``InvalidInput`` naming both."""
    if item.wants_input_logprobs and item.logprob_start_len > prompt_len:
        raise InvalidInput(f"logprob_start_len={item.logprob_start_len} is higher than the number of input tokens "
                           f"{prompt_len}; use a smaller logprob_start_len")
    positions = item.token_ids_logprob_positions if item.return_logprob else None
    if positions is not None and len(positions) != prompt_len - max(item.logprob_start_len, 0):
        raise InvalidInput(f"token_ids_logprob_positions holds {len(positions)} lists; it needs one per input position "
                           f"from logprob_start_len on ({prompt_len - max(item.logprob_start_len, 0)})")


MAX_REPORTED_LOGPROBS = 1 << 22
"""Most ``(logprob, token_id)`` entries one request's answer may hold (top-k and asked ids over its
scored input positions and its output tokens): a bounded answer whatever the body asks for."""


def check_reported_logprobs(item: GenerateItem, prompt_len: int, vocab_size: int) -> None:
    """Every id of ``token_ids_logprob`` (and of its per-position form) names a token of the vocabulary,
    and the answer's top-k and id entries stay within :data:`MAX_REPORTED_LOGPROBS`."""
    rows = [item.token_ids_logprob or ()] + list(item.token_ids_logprob_positions or ())
    bad = next((t for row in rows for t in row if t >= vocab_size), None)
    if bad is not None:
        raise InvalidInput(f"token_ids_logprob: token id {bad} is outside the vocabulary ({vocab_size} tokens)")
    if not item.return_logprob:
        return
    scored = prompt_len - item.logprob_start_len if item.wants_input_logprobs else 0
    per_token = min(item.top_logprobs_num, vocab_size) + len(item.token_ids_logprob or ())
    entries = (scored + item.sampling.max_new_tokens) * per_token + sum(len(r) for r in rows[1:])
    if entries > MAX_REPORTED_LOGPROBS:
        raise InvalidInput(f"top_logprobs_num / token_ids_logprob: the answer would hold {entries} logprob entries, "
                           f"more than {MAX_REPORTED_LOGPROBS}; ask for fewer ids or positions "
                           "(token_ids_logprob_positions scores each position's own ids)")


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed ``/generate`` body: ``batched`` answers with a list, else with one object."""

    items: tuple[GenerateItem, ...]
    batched: bool
    stream: bool


def parse_generate(body: bytes | Any, max_prompt_tokens: int | None = None,
                   max_total_tokens: int | None = None) -> GenerateRequest:
    """``/generate``'s body split into items (``InvalidInput`` naming the field if malformed).

    ``max_prompt_tokens`` (the server's context length) bounds each prompt and
    ``max_total_tokens`` all of them, checked before any per-token work: a big body is first
    counted (its commas bound its ids) and decoded without validation, which costs a fraction
    of the memory full validation of an over-long ``input_ids`` list would."""
    if isinstance(body, (bytes, bytearray)) and len(body) > PRECHECK_BYTES:
        _precheck(bytes(body), max_prompt_tokens, max_total_tokens)
    req = parse_body(GenerateReqInput, body, {MAX_PROMPT_TOKENS: max_prompt_tokens})
    prompts = req.text if req.text is not None else req.input_ids
    items = tuple(
        GenerateItem(
            rid=req.rid[i] or uuid.uuid4().hex,
            input_ids=prompt if req.input_ids is not None else None,
            text=prompt if req.text is not None else None,
            sampling=req.sampling_params[i],
            return_logprob=req.return_logprob[i],
            return_text_in_logprobs=req.return_text_in_logprobs,
            top_logprobs_num=req.top_logprobs_num[i],
            return_routed_experts=req.return_routed_experts,
            routed_experts_start_len=req.routed_experts_start_len[i],
            logprob_start_len=req.logprob_start_len[i] if req.return_logprob[i] else -1,
            extra_key=req.extra_key[i],
            lora_path=req.lora_path[i],
            token_ids_logprob=req.token_ids_logprob[i],
            token_ids_logprob_positions=req.token_ids_logprob_positions[i],
        )
        for i, prompt in enumerate(prompts)
    )
    return GenerateRequest(items=items, batched=req.batched, stream=req.stream)


@dataclass
class FinishReason:
    """SGLang's ``finish_reason`` object: ``{"type": "stop"|"length"|"abort", ...}``."""

    type: str
    extra: dict = field(default_factory=dict)

    @classmethod
    def abort(cls, message: str, status_code: int | None = None, err_type: str | None = None) -> "FinishReason":
        """SGLang's ``FINISH_ABORT``: a plain abort has ``status_code`` null (HTTP 200 with the
        tokens so far); an internal fault carries 500/503 and is answered with that status."""
        return cls("abort", {"message": message, "status_code": status_code, "err_type": err_type})

    @property
    def status_code(self) -> int | None:
        return self.extra.get("status_code") if self.type == "abort" else None

    def to_json(self) -> dict:
        return {"type": self.type, **self.extra}
