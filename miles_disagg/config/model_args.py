"""miles' Megatron model-architecture flags, checked against the HF checkpoint's ``config.json``.

The architecture a run trains is always the one ``--hf-checkpoint`` describes (the megatron
backend builds its ``GPTModel`` from that config). A miles script also states it as flags
(``--num-layers 36 --hidden-size 2560 ...``); each flag given is compared with the config
before anything starts, and a disagreement is a ``ConfigError`` naming the flag, its value
and the config's value. Flags not given are not assumed.
"""

from __future__ import annotations

import ast
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
        value = _GIVEN.get(name, _as_given)(value, hf)
        expected, describe = _EXPECTED[name](hf)
        if not _agrees(value, expected):
            raise ConfigError(f"{_flag(name)} {_show(value)} does not match {CHECKPOINT_FLAG} {path}: its config.json "
                              f"has {describe} {_show(expected)}", (_flag(name), CHECKPOINT_FLAG))


def check_expert_layout(config: RunConfig) -> None:
    """``ConfigError`` when ``--expert-model-parallel-size`` does not divide the checkpoint's
    experts, or asks for expert parallelism on a dense model (skipped while the checkpoint is
    to be created at start-up; the trainer checks again)."""
    ep = config.train.expert_model_parallel_size
    path = config.train.hf_checkpoint
    if ep == 1 or path is None or not (Path(path) / "config.json").is_file():
        return
    experts = _num_experts(load_hf_config(Path(path)))
    flag_name = "--expert-model-parallel-size"
    if not experts:
        raise ConfigError(f"{flag_name} {ep} splits MoE experts, but {CHECKPOINT_FLAG} {path} is a dense model "
                          f"(its config.json has no num_experts): use {flag_name} 1", (flag_name, CHECKPOINT_FLAG))
    if experts % ep:
        raise ConfigError(f"{flag_name} {ep} does not divide the {experts} experts of {CHECKPOINT_FLAG} {path}",
                          (flag_name, CHECKPOINT_FLAG))


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


def _num_experts(hf: Any) -> int:
    return int(getattr(hf, "num_experts", None) or 0)


def sparse_layer_flags(hf: Any) -> tuple[bool, ...]:
    """HF Qwen3-MoE's rule: layer ``i`` has experts iff it is not in ``mlp_only_layers``, there
    are experts, and ``(i + 1) % decoder_sparse_step == 0``."""
    experts = _num_experts(hf)
    step = getattr(hf, "decoder_sparse_step", None) or 1
    dense = set(getattr(hf, "mlp_only_layers", None) or ())
    return tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(hf.num_hidden_layers))


def _sparse_layers(hf: Any) -> list[int]:
    """1 for each layer with experts, as megatron's --moe-layer-freq lists them."""
    return [int(flag) for flag in sparse_layer_flags(hf)]


def _as_given(value: Any, hf: Any) -> Any:
    return value


def _layer_pattern(value: str, hf: Any) -> list[int]:
    """megatron's --moe-layer-freq: an integer N (layer i is MoE iff i % N == 0) or a list
    expression of 0/1 per layer (``[1, 1, 0]``, ``([0]*3+[1]*45)``)."""
    try:
        parsed = _int_list_expression(ast.parse(value.strip(), mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        raise ConfigError(f"--moe-layer-freq {value!r}: expected an integer or a list of 0/1 per layer such as "
                          f"[1, 1, 0] ({exc})", ("--moe-layer-freq",)) from None
    if isinstance(parsed, int):
        if parsed < 1:
            raise ConfigError(f"--moe-layer-freq {value!r} must be >= 1", ("--moe-layer-freq",))
        return [int(i % parsed == 0) for i in range(hf.num_hidden_layers)]
    if any(item not in (0, 1) for item in parsed):
        raise ConfigError(f"--moe-layer-freq {value!r}: list items must be 0 or 1", ("--moe-layer-freq",))
    return list(parsed)


_MAX_LAYERS = 100_000


def _int_list_expression(node: ast.AST) -> int | list[int]:
    """An integer, a list of integers, or ``+`` / ``*`` of those (nothing else is evaluated)."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        items = [_int_list_expression(item) for item in node.elts]
        if not all(isinstance(item, int) for item in items):
            raise ValueError("nested lists")
        return items
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _int_list_expression(node.left), _int_list_expression(node.right)
        if isinstance(node.op, ast.Add) and type(left) is type(right):
            if isinstance(left, list) and len(left) + len(right) > _MAX_LAYERS:
                raise ValueError("too large")
            return left + right
        if isinstance(node.op, ast.Mult) and (isinstance(left, int) or isinstance(right, int)):
            size = (len(left) if isinstance(left, list) else 1) * (len(right) if isinstance(right, list) else 1)
            if isinstance(left, list) or isinstance(right, list):
                size *= abs(left) if isinstance(left, int) else abs(right)
            if size > _MAX_LAYERS or (isinstance(left, int) and isinstance(right, int) and abs(left * right) > _MAX_LAYERS):
                raise ValueError("too large")
            return left * right
    raise ValueError(f"unsupported expression {ast.dump(node)[:60]}")


_GIVEN: dict[str, Callable[[Any, Any], Any]] = {"moe_layer_freq": _layer_pattern}


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
    "rotary_percent": lambda hf: (float(getattr(hf, "partial_rotary_factor", None) or 1.0), "partial_rotary_factor"),
    "num_experts": lambda hf: (_num_experts(hf), "num_experts"),
    "moe_router_topk": lambda hf: (getattr(hf, "num_experts_per_tok", None), "num_experts_per_tok"),
    "moe_ffn_hidden_size": lambda hf: (getattr(hf, "moe_intermediate_size", None), "moe_intermediate_size"),
    "moe_layer_freq": lambda hf: (_sparse_layers(hf), "MoE layers (decoder_sparse_step, mlp_only_layers)"),
    "moe_shared_expert_intermediate_size": lambda hf: (getattr(hf, "shared_expert_intermediate_size", None),
                                                       "shared_expert_intermediate_size"),
    "moe_router_score_function": lambda hf: (getattr(hf, "scoring_func", None) or "softmax",
                                             "router scoring (scoring_func)"),
    "moe_router_pre_softmax": lambda hf: (not bool(getattr(hf, "norm_topk_prob", False)),
                                          f"norm_topk_prob {str(bool(getattr(hf, 'norm_topk_prob', False))).lower()}, i.e. "
                                          "moe_router_pre_softmax"),
    "moe_router_topk_scaling_factor": lambda hf: (float(getattr(hf, "routed_scaling_factor", None) or 1.0),
                                                  "routed_scaling_factor"),
}

assert set(_EXPECTED) == {name for name in ModelConfig.__dataclass_fields__}, "every model flag has a check"
