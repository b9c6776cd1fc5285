"""miles' Megatron model-architecture flags, checked against the HF checkpoint's ``config.json``.

The architecture a run trains is always the one ``--hf-checkpoint`` describes (the megatron
backend builds its ``GPTModel`` from that config). A miles script also states it as flags
(``--num-layers 36 --hidden-size 2560 ...``); each flag given is compared with the config
before anything starts, and a disagreement is a ``ConfigError`` naming the flag, its value
and the config's value. Flags not given are not assumed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from miles_disagg.config.components import ModelConfig, RunConfig
from miles_disagg.types import ConfigError

CHECKPOINT_FLAG = "--hf-checkpoint"


def check_model_args(config: RunConfig) -> None:
    """``ConfigError`` for the first architecture flag that disagrees with ``config.json``.

    Skipped when no architecture flag is given, or when the checkpoint will be created at
    start-up (``--hf-checkpoint-init``; the launcher checks again once it exists)."""
    given = config.model.given()
    if not given:
        return
    path = config.train.hf_checkpoint
    if path is None:
        raise ConfigError(f"{_flag(next(iter(given)))} is checked against the model's config.json: give "
                          f"{CHECKPOINT_FLAG}", (CHECKPOINT_FLAG, _flag(next(iter(given)))))
    directory = Path(path)
    if not directory.exists() and config.train.hf_checkpoint_init != "none":
        return
    hf = load_hf_config(directory)
    for name, value in given.items():
        expected, describe = _EXPECTED[name](hf)
        if not _agrees(value, expected):
            raise ConfigError(f"{_flag(name)} {_show(value)} does not match {CHECKPOINT_FLAG} {path}: its config.json "
                              f"has {describe} {_show(expected)}", (_flag(name), CHECKPOINT_FLAG))


def load_hf_config(directory: Path) -> Any:
    """The checkpoint's HF config (as the trainer reads it; a model's ``text_config`` when nested)."""
    if not (directory / "config.json").is_file():
        raise ConfigError(f"{CHECKPOINT_FLAG} {str(directory)!r} has no config.json", (CHECKPOINT_FLAG,))
    from miles_disagg.config.hf_config import read_hf_config

    try:
        hf = read_hf_config(directory)
    except (ValueError, OSError, KeyError) as exc:
        raise ConfigError(f"{CHECKPOINT_FLAG} {str(directory)!r}: cannot read config.json ({exc})",
                          (CHECKPOINT_FLAG,)) from None
    return getattr(hf, "text_config", None) or hf


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _show(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else repr(value) if isinstance(value, str) else str(value)


def _agrees(given: Any, expected: Any) -> bool:
    if isinstance(given, float) or isinstance(expected, float):
        return expected is not None and math.isclose(float(given), float(expected), rel_tol=1e-9, abs_tol=0.0)
    return given == expected


def _rope_theta(hf: Any) -> float | None:
    rope = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta if theta is not None else getattr(hf, "rope_theta", None)
    return None if theta is None else float(theta)


def _heads(hf: Any) -> int:
    return hf.num_attention_heads


def _kv_heads(hf: Any) -> int:
    return getattr(hf, "num_key_value_heads", None) or _heads(hf)


def _qkv_bias(hf: Any) -> bool:
    if getattr(hf, "attention_bias", None) is not None:
        return bool(hf.attention_bias)
    return getattr(hf, "model_type", "") == "qwen2"  # Qwen2 has QKV biases without saying so


def _norm(hf: Any) -> str:
    return "RMSNorm" if getattr(hf, "rms_norm_eps", None) is not None else "LayerNorm"


def _norm_eps(hf: Any) -> float | None:
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon"):
        if getattr(hf, key, None) is not None:
            return float(getattr(hf, key))
    return None


def _qk_norm(hf: Any) -> bool:
    return bool(getattr(hf, "qk_layernorm", False) or getattr(hf, "use_qk_norm", False)
                or str(getattr(hf, "model_type", "")).startswith("qwen3"))


# field -> config.json -> (the value the flag must have, what the config calls it)
_EXPECTED: dict[str, Callable[[Any], tuple[Any, str]]] = {
    "swiglu": lambda hf: (getattr(hf, "hidden_act", None) in ("silu", "swish"),
                          f"hidden_act {getattr(hf, 'hidden_act', None)!r}, i.e. swiglu"),
    "num_layers": lambda hf: (hf.num_hidden_layers, "num_hidden_layers"),
    "hidden_size": lambda hf: (hf.hidden_size, "hidden_size"),
    "ffn_hidden_size": lambda hf: (getattr(hf, "intermediate_size", None), "intermediate_size"),
    "num_attention_heads": lambda hf: (_heads(hf), "num_attention_heads"),
    "group_query_attention": lambda hf: (_kv_heads(hf) < _heads(hf),
                                         f"num_key_value_heads {_kv_heads(hf)} of {_heads(hf)} heads, i.e. "
                                         "group_query_attention"),
    "num_query_groups": lambda hf: (_kv_heads(hf), "num_key_value_heads"),
    "kv_channels": lambda hf: (getattr(hf, "head_dim", None) or hf.hidden_size // _heads(hf), "head_dim"),
    "use_rotary_position_embeddings": lambda hf: (_rope_theta(hf) is not None, "rope_theta set, i.e. rotary"),
    "position_embedding_type": lambda hf: ("rope" if _rope_theta(hf) is not None else "learned_absolute",
                                           "position embeddings"),
    "rotary_base": lambda hf: (_rope_theta(hf), "rope_theta"),
    "disable_bias_linear": lambda hf: (not _qkv_bias(hf) and not getattr(hf, "mlp_bias", False),
                                       f"attention_bias {_qkv_bias(hf)}, i.e. disable_bias_linear"),
    "add_qkv_bias": lambda hf: (_qkv_bias(hf), "attention_bias"),
    "normalization": lambda hf: (_norm(hf), "normalization"),
    "norm_epsilon": lambda hf: (_norm_eps(hf), "rms_norm_eps"),
    "qk_layernorm": lambda hf: (_qk_norm(hf), f"model_type {getattr(hf, 'model_type', None)!r}, i.e. qk_layernorm"),
    "vocab_size": lambda hf: (hf.vocab_size, "vocab_size"),
    "max_position_embeddings": lambda hf: (getattr(hf, "max_position_embeddings", None), "max_position_embeddings"),
    "untie_embeddings_and_output_weights": lambda hf: (not bool(getattr(hf, "tie_word_embeddings", False)),
                                                       f"tie_word_embeddings {bool(getattr(hf, 'tie_word_embeddings', False))}, "
                                                       "i.e. untie_embeddings_and_output_weights"),
}

assert set(_EXPECTED) == {name for name in ModelConfig.__dataclass_fields__}, "every model flag has a check"
