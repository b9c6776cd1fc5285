"""Request bodies of SGLang's HTTP API, parsed and validated into dataclasses.

Field names and defaults follow SGLang's ``io_struct.py`` (``GenerateReqInput``,
``UpdateWeightFromDiskReqInput``, ``PauseGenerationReqInput``, ``AbortReq``,
``InitWeightsUpdateGroupReqInput``, ``UpdateWeightsFromDistributedReqInput``,
``UpdateWeightVersionReqInput``) plus this project's ``PullWeightsReqInput``. Every
parser raises ``InvalidInput`` with a message naming the field; nothing is half-parsed.
Unknown fields are ignored, as SGLang ignores fields it does not use.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from miles_disagg.httpjson import parse_json  # noqa: F401  (re-exported: protocol.parse_json)
from miles_disagg.types import InvalidInput

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default

# SGLang sampling knobs this engine does not implement, with their no-op values. A client that
# sends the no-op value (as SGLang clients commonly do) is served; any other value is refused
# with 400 rather than silently sampling from a different distribution than the one asked for.
UNSUPPORTED_SAMPLING = {
    "n": 1, "min_new_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None,
    "logit_bias": None, "custom_params": None,
}


# parse_json lives in miles_disagg.httpjson (shared with the agent and the router)


# --------------------------------------------------------------------------- field checks


def _get(obj: dict, name: str, kinds: tuple, default: Any) -> Any:
    value = obj.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise InvalidInput(f"{name} must be {_describe(kinds)}, got {value!r}")
    if not isinstance(value, kinds):
        raise InvalidInput(f"{name} must be {_describe(kinds)}, got {type(value).__name__} {value!r}")
    return value


def _describe(kinds: tuple) -> str:
    return " or ".join(k.__name__ for k in kinds)


def _number(obj: dict, name: str, default: float, low: float, high: float) -> float:
    value = float(_get(obj, name, (int, float), default))
    if not low <= value <= high:
        raise InvalidInput(f"sampling_params.{name} must be in [{low}, {high}], got {value}")
    return value


def _int_list(obj: dict, name: str) -> list[int]:
    value = _get(obj, name, (list,), [])
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise InvalidInput(f"{name} must be a list of ints, got {value!r}")
    return list(value)


# --------------------------------------------------------------------------- generate


@dataclass(frozen=True)
class SamplingParams:
    """SGLang's ``sampling_params`` subset (same names, same defaults)."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: the whole vocabulary
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None

    @classmethod
    def from_json(cls, obj: Any) -> "SamplingParams":
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise InvalidInput(f"sampling_params must be an object, got {type(obj).__name__}")
        _refuse_unsupported(obj)
        max_new = _get(obj, "max_new_tokens", (int,), DEFAULT_MAX_NEW_TOKENS)
        if max_new < 0:
            raise InvalidInput(f"sampling_params.max_new_tokens must be >= 0, got {max_new}")
        stop = _get(obj, "stop", (str, list), [])
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidInput(f"sampling_params.stop must be a string or a list of non-empty strings, got {stop!r}")
        top_k = _get(obj, "top_k", (int,), -1)
        if top_k < -1:
            raise InvalidInput(f"sampling_params.top_k must be -1 (all) or >= 0, got {top_k}")
        seed = _get(obj, "sampling_seed", (int,), None)
        return cls(
            max_new_tokens=max_new,
            temperature=_number(obj, "temperature", 1.0, 0.0, 1e4),
            top_p=_number(obj, "top_p", 1.0, 1e-9, 1.0),
            top_k=top_k,
            min_p=_number(obj, "min_p", 0.0, 0.0, 1.0),
            stop=tuple(stop),
            stop_token_ids=tuple(_int_list(obj, "stop_token_ids")),
            ignore_eos=_get(obj, "ignore_eos", (bool,), False),
            no_stop_trim=_get(obj, "no_stop_trim", (bool,), False),
            skip_special_tokens=_get(obj, "skip_special_tokens", (bool,), True),
            sampling_seed=seed,
        )


# Top-level ``/generate`` fields of SGLang this engine does not implement, with their no-op
# values (a list of no-op values, one per batch item, is accepted too).
UNSUPPORTED_GENERATE = {
    "logprob_start_len": (-1,), "token_ids_logprob": (), "return_hidden_states": (False,),
    "return_routed_experts": (False,), "return_indexer_topk": (False,), "return_sampling_mask": (False,),
    "lora_path": (), "input_embeds": (), "image_data": (), "video_data": (), "audio_data": (),
}


def _refuse_unsupported_fields(obj: dict) -> None:
    for name, noops in UNSUPPORTED_GENERATE.items():
        value = obj.get(name)
        values = value if isinstance(value, list) and name not in ("token_ids_logprob", "input_embeds") else [value]
        if any(v is not None and v not in noops for v in values):
            raise InvalidInput(f"{name}={value!r} is not supported by the built-in engine")


def _refuse_unsupported(obj: dict) -> None:
    for name, noop in UNSUPPORTED_SAMPLING.items():
        value = obj.get(name)
        if value is not None and value != noop:
            raise InvalidInput(f"sampling_params.{name}={value!r} is not supported by the built-in engine "
                               f"(only {noop!r} or null)")


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


@dataclass(frozen=True)
class GenerateRequest:
    """A parsed ``/generate`` body: ``batched`` answers with a list, else with one object."""

    items: tuple[GenerateItem, ...]
    batched: bool
    stream: bool


def parse_generate(obj: dict) -> GenerateRequest:
    """``GenerateReqInput``: exactly one of ``text``/``input_ids``, each single or batched."""
    text, input_ids = obj.get("text"), obj.get("input_ids")
    if (text is None) == (input_ids is None):
        raise InvalidInput("give exactly one of text or input_ids")
    _refuse_unsupported_fields(obj)
    prompts, batched = _prompts(text, input_ids)
    count = len(prompts)
    sampling = _per_item(obj.get("sampling_params"), count, "sampling_params", dict)
    return_logprob = _per_item(obj.get("return_logprob", False), count, "return_logprob", bool)
    top_logprobs = _per_item(obj.get("top_logprobs_num"), count, "top_logprobs_num", int)
    if any(k is not None and k < 0 for k in top_logprobs):
        raise InvalidInput(f"top_logprobs_num must be >= 0, got {obj.get('top_logprobs_num')!r}")
    rids = _rids(obj.get("rid"), count, batched)
    text_in_logprobs = _get(obj, "return_text_in_logprobs", (bool,), False)
    items = tuple(
        GenerateItem(
            rid=rids[i] or uuid.uuid4().hex,
            input_ids=prompts[i] if input_ids is not None else None,
            text=prompts[i] if text is not None else None,
            sampling=SamplingParams.from_json(sampling[i]),
            return_logprob=bool(return_logprob[i]),
            return_text_in_logprobs=text_in_logprobs,
            top_logprobs_num=top_logprobs[i] or 0,
        )
        for i in range(count)
    )
    stream = _get(obj, "stream", (bool,), False)
    if stream and batched:
        raise InvalidInput("stream=true is supported for single requests only")
    return GenerateRequest(items=items, batched=batched, stream=stream)


def _prompts(text: Any, input_ids: Any) -> tuple[list, bool]:
    if text is not None:
        if isinstance(text, str):
            return [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            return list(text), True
        raise InvalidInput("text must be a string or a non-empty list of strings")
    if not isinstance(input_ids, list) or not input_ids:
        raise InvalidInput("input_ids must be a non-empty list of ints or of lists of ints")
    if all(_is_int(t) for t in input_ids):
        return [tuple(input_ids)], False
    if all(isinstance(seq, list) and seq and all(_is_int(t) for t in seq) for seq in input_ids):
        return [tuple(seq) for seq in input_ids], True
    raise InvalidInput("input_ids must be a non-empty list of ints or of non-empty lists of ints")


def _rids(value: Any, count: int, batched: bool) -> list:
    """SGLang's ``rid``: one string, or one per item; a string for a batch is a prefix (``rid_i``)."""
    if batched and isinstance(value, str):
        return [f"{value}_{i}" for i in range(count)]
    rids = _per_item(value, count, "rid", str)
    if len(set(r for r in rids if r)) != len([r for r in rids if r]):
        raise InvalidInput(f"rid values must be distinct within a request, got {rids!r}")
    return rids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_item(value: Any, count: int, name: str, kind: type) -> list:
    """SGLang lets a batch share one value or give one per item."""
    if isinstance(value, list):
        if len(value) != count:
            raise InvalidInput(f"{name} has {len(value)} entries for a batch of {count}")
        values = value
    else:
        values = [value] * count
    for v in values:
        if v is not None and (not isinstance(v, kind) or (kind is not bool and isinstance(v, bool))):
            raise InvalidInput(f"{name} must be {kind.__name__}, got {type(v).__name__} {v!r}")
    return values


# --------------------------------------------------------------------------- control endpoints


@dataclass(frozen=True)
class UpdateFromDisk:
    """``UpdateWeightFromDiskReqInput`` (fields this engine acts on)."""

    model_path: str
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True

    @classmethod
    def from_json(cls, obj: dict) -> "UpdateFromDisk":
        model_path = _get(obj, "model_path", (str,), "")
        if not model_path:
            raise InvalidInput("model_path is required")
        return cls(
            model_path=model_path,
            weight_version=_version_string(obj.get("weight_version"), "weight_version"),
            abort_all_requests=_get(obj, "abort_all_requests", (bool,), False),
            flush_cache=_get(obj, "flush_cache", (bool,), True),
        )


def _version_string(value: Any, name: str) -> str | None:
    """SGLang's versions are strings; ints are accepted and reported as their decimal string."""
    if value is None:
        return None
    if _is_int(value):
        return str(value)
    if isinstance(value, str) and value:
        return value
    raise InvalidInput(f"{name} must be a non-empty string or an int, got {value!r}")


PAUSE_MODES = ("abort", "retract", "in_place")


def parse_pause_mode(obj: dict) -> str:
    mode = _get(obj, "mode", (str,), "abort")
    if mode not in PAUSE_MODES:
        raise InvalidInput(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


def parse_new_version(obj: dict) -> tuple[str, bool]:
    """``UpdateWeightVersionReqInput``: ``new_version`` and ``abort_all_requests`` (default true)."""
    version = _version_string(obj.get("new_version"), "new_version")
    if version is None:
        raise InvalidInput("new_version is required")
    return version, _get(obj, "abort_all_requests", (bool,), True)


def parse_abort(obj: dict) -> tuple[str, bool]:
    """``AbortReq``: ``rid`` and ``abort_all``."""
    return _get(obj, "rid", (str,), ""), _get(obj, "abort_all", (bool,), False)


@dataclass(frozen=True)
class InitGroup:
    """``InitWeightsUpdateGroupReqInput``."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"

    @classmethod
    def from_json(cls, obj: dict) -> "InitGroup":
        for required in ("master_address", "master_port", "rank_offset", "world_size"):
            if obj.get(required) is None:
                raise InvalidInput(f"{required} is required")
        group = cls(
            master_address=_get(obj, "master_address", (str,), ""),
            master_port=_get(obj, "master_port", (int,), 0),
            rank_offset=_get(obj, "rank_offset", (int,), 0),
            world_size=_get(obj, "world_size", (int,), 0),
            group_name=_get(obj, "group_name", (str,), "weight_update_group"),
            backend=_get(obj, "backend", (str,), "nccl"),
        )
        if not 0 < group.rank_offset < group.world_size or not 0 < group.master_port < 65536:
            raise InvalidInput(f"need 0 < rank_offset < world_size and a valid port, got {group}")
        return group


def parse_group_name(obj: dict) -> str:
    """``DestroyWeightsUpdateGroupReqInput``: ``group_name`` (default ``weight_update_group``)."""
    return _get(obj, "group_name", (str,), "weight_update_group")


@dataclass(frozen=True)
class DistributedUpdate:
    """``UpdateWeightsFromDistributedReqInput``: names/dtypes/shapes broadcast from rank 0."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True

    @classmethod
    def from_json(cls, obj: dict) -> "DistributedUpdate":
        names = _get(obj, "names", (list,), None)
        dtypes = _get(obj, "dtypes", (list,), None)
        shapes = _get(obj, "shapes", (list,), None)
        if names is None or dtypes is None or shapes is None:
            raise InvalidInput("names, dtypes and shapes are required")
        if not len(names) == len(dtypes) == len(shapes):
            raise InvalidInput("names, dtypes and shapes must have the same length")
        if not all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in shapes):
            raise InvalidInput("shapes must be lists of non-negative ints")
        return cls(
            names=tuple(str(n) for n in names),
            dtypes=tuple(str(d) for d in dtypes),
            shapes=tuple(tuple(s) for s in shapes),
            group_name=_get(obj, "group_name", (str,), "weight_update_group"),
            weight_version=_version_string(obj.get("weight_version"), "weight_version"),
            abort_all_requests=_get(obj, "abort_all_requests", (bool,), False),
            flush_cache=_get(obj, "flush_cache", (bool,), True),
        )


@dataclass(frozen=True)
class PullWeights:
    """This project's ``/pull_weights``: materialize and stage a published version."""

    target_version: int
    source_dir: str
    local_checkpoint_dir: str

    @classmethod
    def from_json(cls, obj: dict) -> "PullWeights":
        version = obj.get("target_version")
        if isinstance(version, str) and version.isdigit():
            version = int(version)
        if not _is_int(version) or version < 0:
            raise InvalidInput(f"target_version must be a non-negative int, got {version!r}")
        source = _get(obj, "source_dir", (str,), "")
        local = _get(obj, "local_checkpoint_dir", (str,), "")
        if not source or not local:
            raise InvalidInput("source_dir and local_checkpoint_dir are required")
        return cls(target_version=version, source_dir=source, local_checkpoint_dir=local)


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
