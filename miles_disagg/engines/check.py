"""Attach-time checks: does an engine someone else launched serve what this job expects?

An attached engine (``--rollout-external-engine-addrs``) answers ``/get_server_info`` and
``/get_model_info``; :func:`check_engine_matches` compares them with the job's
expectation and returns one message per mismatch (an empty list: it matches). Pure: the
caller fetches the two dicts (SGLang's shapes; the built-in engine reports the same keys).

What is compared, and how:

* ``architectures``: model info ``architectures`` vs the job checkpoint's ``config.json``
  ``architectures``. Engines that do not report it (older SGLang) are compared on
  ``model_type`` instead.
* ``tp_size``: server info ``tp_size`` vs ``--rollout-num-gpus-per-engine``.
* ``dtype``: server info ``dtype`` vs the expected dtype. ``half``/``float`` are SGLang's
  aliases of ``float16``/``float32``. An expected ``auto`` means the job checkpoint's
  ``torch_dtype``. An engine reporting ``auto`` (SGLang reports its argument; the built-in
  engine reports the resolved dtype) is resolved as SGLang resolves it, against the job
  checkpoint's ``torch_dtype`` (the architecture check ties the two checkpoints together):
  ``float32`` checkpoints are served in ``float16``, anything else in its own dtype.
* ``context_length``: a *requirement*, not an equality: the engine must accept at least
  ``EngineExpectation.context_length`` tokens (prompt + response), by default the job
  checkpoint's ``max_position_embeddings``; a longer engine context is fine. An engine
  reporting ``context_length: null`` (SGLang without ``--context-length``) uses its
  checkpoint's own value, taken to be the job checkpoint's.

Every compared field must be reported, with a value of the right JSON type: a field that is
absent, or wrongly typed (``tp_size: "two"``, ``architectures: 5``, ``/server_info`` answering a
list), is a problem naming the field and what was found, never a silent pass. So a server that
answers ``{}`` to everything matches nothing. :func:`unreported_fields` names the absent ones.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from miles_disagg.types import ConfigError

DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}
NUM_GPUS_FLAG = "--rollout-num-gpus-per-engine"


@dataclass(frozen=True)
class EngineExpectation:
    """What the job needs from every engine it attaches to."""

    architectures: tuple[str, ...]  # config.json "architectures" of the job's checkpoint
    model_type: str | None  # config.json "model_type"
    tp_size: int  # --rollout-num-gpus-per-engine
    dtype: str  # resolved weight dtype ("bfloat16", "float32", ...), never "auto"
    checkpoint_dtype: str | None  # the checkpoint's torch_dtype (resolves an engine's "auto")
    context_length: int | None  # tokens the engine must accept; None: not checked
    checkpoint_context_length: int | None = None  # the checkpoint's max_position_embeddings

    @classmethod
    def from_hf_checkpoint(cls, path: str | Path, tp_size: int, dtype: str = "auto",
                           context_length: int | None = None) -> "EngineExpectation":
        """Read ``config.json`` of the job's HF checkpoint (``--hf-checkpoint``).

        ``dtype`` ``auto`` means the checkpoint's ``torch_dtype``; ``context_length`` defaults
        to its ``max_position_embeddings``. ``ConfigError`` when the checkpoint has no
        readable ``config.json`` or ``auto`` cannot be resolved.
        """
        config = _read_config(Path(path))
        checkpoint_dtype = _config_dtype(config)
        wanted = normalize_dtype(dtype)
        if wanted == "auto":
            if checkpoint_dtype is None:
                raise ConfigError(f"dtype 'auto' needs a torch_dtype in {path}/config.json, which has none")
            wanted = checkpoint_dtype
        max_positions = _text_config(config).get("max_position_embeddings")
        max_positions = int(max_positions) if isinstance(max_positions, int) else None
        return cls(
            architectures=tuple(config.get("architectures") or ()),
            model_type=config.get("model_type"),
            tp_size=int(tp_size),
            dtype=wanted,
            checkpoint_dtype=checkpoint_dtype,
            context_length=context_length if context_length is not None else max_positions,
            checkpoint_context_length=max_positions,
        )


def check_engine_matches(expected: EngineExpectation, server_info: Any, model_info: Any) -> list[str]:
    """One message per mismatch, naming the field and both values (an absent or wrongly typed field
    is one too); ``[]`` when the engine fits. ``server_info`` / ``model_info``: the engine's JSON
    answers as decoded (anything but an object is a problem of its own)."""
    shapes = [f"{path} answered {_json_kind(answer)}, not a JSON object" for path, answer
              in (("/server_info", server_info), ("/model_info", model_info)) if not isinstance(answer, dict)]
    if shapes:
        return shapes
    problems = [
        _check_architecture(expected, model_info),
        _check_tp_size(expected, server_info),
        _check_dtype(expected, server_info),
        _check_context_length(expected, server_info),
    ]
    return [p for p in problems if p is not None]


def unreported_fields(server_info: dict, model_info: dict) -> list[str]:
    """Fields :func:`check_engine_matches` could not compare because the engine does not report them."""
    missing = []
    if not model_info.get("architectures") and not model_info.get("model_type"):
        missing.append("architectures")
    for key in ("tp_size", "dtype"):
        if server_info.get(key) is None:
            missing.append(key)
    if "context_length" not in server_info:
        missing.append("context_length")
    return missing


def normalize_dtype(name: str) -> str:
    """SGLang/torch spellings to one name: ``half`` -> ``float16``, ``torch.bfloat16`` -> ``bfloat16``."""
    name = str(name).strip().lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def sglang_auto_dtype(checkpoint_dtype: str) -> str:
    """The dtype SGLang serves with ``--dtype auto``: float16 for float32 checkpoints, else the checkpoint's."""
    resolved = normalize_dtype(checkpoint_dtype)
    return "float16" if resolved == "float32" else resolved


# --------------------------------------------------------------------------- one check per field


def _check_architecture(expected: EngineExpectation, model_info: dict) -> str | None:
    served = model_info.get("architectures")
    if isinstance(served, str):
        served = [served]
    if served is not None and not (isinstance(served, list) and all(isinstance(a, str) for a in served)):
        return f"architectures: the engine reports {_shown(served)} in /model_info, not a list of names"
    if served and expected.architectures:
        if list(served) != list(expected.architectures):
            return (f"architectures: the engine serves {list(served)}, "
                    f"the job's checkpoint has {list(expected.architectures)}")
        return None
    served_type = model_info.get("model_type")
    if served_type is not None and not isinstance(served_type, str):
        return f"model_type: the engine reports {_shown(served_type)} in /model_info, not a name"
    if served_type and expected.model_type:
        if served_type != expected.model_type:
            return f"model_type: the engine serves {served_type!r}, the job's checkpoint has {expected.model_type!r}"
        return None
    return ("architectures: the engine reports neither architectures nor model_type in /model_info, so the "
            "model it serves cannot be compared with the job's checkpoint")


def _check_tp_size(expected: EngineExpectation, server_info: dict) -> str | None:
    if "tp_size" not in server_info:
        return f"tp_size: the engine does not report it in /server_info ({NUM_GPUS_FLAG} is {expected.tp_size})"
    served = server_info["tp_size"]
    if not _is_count(served):
        return f"tp_size: the engine reports {_shown(served)} in /server_info, not a number"
    if served == expected.tp_size:
        return None
    return f"tp_size: the engine runs tp_size={served}, {NUM_GPUS_FLAG} is {expected.tp_size}"


def _check_dtype(expected: EngineExpectation, server_info: dict) -> str | None:
    reported = server_info.get("dtype")
    if reported is None:
        return f"dtype: the engine does not report it in /server_info (the job expects {expected.dtype})"
    if not isinstance(reported, str):
        return f"dtype: the engine reports {_shown(reported)} in /server_info, not a dtype name"
    served = normalize_dtype(reported)
    if served == "auto":
        if expected.checkpoint_dtype is None:
            return (f"dtype: the engine runs dtype 'auto' and the job's checkpoint declares no torch_dtype, "
                    f"so it cannot be compared with the expected {expected.dtype!r}")
        served = sglang_auto_dtype(expected.checkpoint_dtype)
    if served == expected.dtype:
        return None
    shown = served if served == str(reported) else f"{served} (reported as {reported!r})"
    return f"dtype: the engine serves {shown}, the job expects {expected.dtype}"


def _check_context_length(expected: EngineExpectation, server_info: dict) -> str | None:
    if expected.context_length is None:
        return None
    if "context_length" not in server_info:
        return (f"context_length: the engine does not report it in /server_info (the job needs "
                f"{expected.context_length} tokens)")
    served = server_info["context_length"]
    if served is None:  # SGLang without --context-length: its checkpoint's own value
        served = expected.checkpoint_context_length
        if served is None:
            return None
    elif not _is_count(served):
        return f"context_length: the engine reports {_shown(served)} in /server_info, not a number"
    if served >= expected.context_length:
        return None
    return (f"context_length: the engine accepts {served} tokens, "
            f"the job needs {expected.context_length}")


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A reported value for a message (bounded: the engine chose it)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _json_kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number")


# --------------------------------------------------------------------------- config.json


def _read_config(path: Path) -> dict[str, Any]:
    config_path = path / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} is not an HF checkpoint directory (no config.json)", flags=("--hf-checkpoint",)) from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {config_path}: {exc}", flags=("--hf-checkpoint",)) from None
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path} is not a JSON object", flags=("--hf-checkpoint",))
    return config


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal configs keep the language model's fields under ``text_config``."""
    if "max_position_embeddings" not in config and isinstance(config.get("text_config"), dict):
        return config["text_config"]
    return config


def _config_dtype(config: dict[str, Any]) -> str | None:
    """``torch_dtype`` (``dtype`` in transformers 5 configs), normalized; None when absent."""
    for source in (config, _text_config(config)):
        for key in ("torch_dtype", "dtype"):
            if isinstance(source.get(key), str):
                return normalize_dtype(source[key])
    return None
