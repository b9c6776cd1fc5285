"""A checkpoint's ``config.json`` as transformers reads it, without importing transformers for
the architectures this project builds itself.

``transformers.AutoConfig`` costs about 4.5 CPU-seconds to import (it pulls in torch), in every
process that checks model flags (the driver) or builds a Megatron model (each trainer rank). For
``model_type`` ``qwen3`` the config is config.json over transformers' ``Qwen3Config`` defaults
(the values it fills in for keys a file leaves out), read as attributes; any other model type
is transformers' own ``AutoConfig``. A unit test compares the two on real and partial configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

QWEN3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
    "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "attention_bias": False, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 28, "attention_dropout": 0.0,
    "pad_token_id": None, "bos_token_id": None, "eos_token_id": None,
}
"""transformers' ``Qwen3Config`` defaults (its ``rope_parameters`` default: theta 10000, default type)."""


QWEN3_MOE_DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
    "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
    "router_aux_loss_coef": 0.001, "mlp_only_layers": [], "pad_token_id": None, "bos_token_id": None,
    "eos_token_id": None,
}
"""transformers' ``Qwen3MoeConfig`` defaults (``head_dim`` absent: ``hidden_size // num_attention_heads``)."""


def qwen3_values(config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Qwen3 over transformers' defaults (``num_key_value_heads`` null: one per head)."""
    values = {**QWEN3_DEFAULTS, **config}
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    return values


def qwen3_moe_values(config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Qwen3-MoE over transformers' defaults: ``num_local_experts`` (transformers 5's
    alias) stands for ``num_experts``; ``num_key_value_heads`` null: one per head; ``head_dim``
    absent or null: ``hidden_size // num_attention_heads``."""
    values = {**QWEN3_MOE_DEFAULTS, **config}
    if "num_experts" not in config and "num_local_experts" in config:
        values["num_experts"] = config["num_local_experts"]
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    values["head_dim"] = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    return values


def read_hf_config(directory: str | Path) -> Any:
    """The checkpoint's config as attributes; ``ValueError``/``OSError`` for an unreadable file."""
    path = Path(directory) / "config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    if config.get("model_type") == "qwen3":
        return SimpleNamespace(**qwen3_values(config))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(directory))
