"""The tensors of a Qwen3 / Qwen3-MoE checkpoint: on-disk names and shapes, from config.json keys.

One list for everything that needs a model's tensors without loading one (benchmarks' synthetic
models, conversion tests); the native models (:mod:`miles_disagg.models.qwen3`,
:mod:`miles_disagg.models.qwen3_moe`) hold exactly these names. No torch here: the driver and
the benchmarks import it cheaply.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

Shape = tuple[int, ...]


def is_sparse_layer(layer: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers: Iterable[int]) -> bool:
    """HF's rule for a Qwen3-MoE layer with experts (``mlp.gate`` and ``mlp.experts.E``) rather
    than a dense MLP: ``layer not in mlp_only_layers and num_experts > 0 and (layer + 1) %
    decoder_sparse_step == 0``."""
    return layer not in tuple(mlp_only_layers) and num_experts > 0 and (layer + 1) % decoder_sparse_step == 0


def qwen3_tensor_shapes(config: Mapping[str, Any]) -> list[tuple[str, Shape]]:
    """``(name, shape)`` of every tensor, in checkpoint order: the embedding, each layer (norms,
    attention with its q/k norms, the MLP or the router and experts), the final norm, ``lm_head``
    unless ``tie_word_embeddings``.

    ``config`` holds config.json's keys, without transformers' defaults filled in (see
    :mod:`miles_disagg.config.hf_config` for them): ``vocab_size``, ``hidden_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` are
    required; ``intermediate_size`` when a layer is dense; ``num_experts`` (or transformers 5's
    ``num_local_experts``; absent: 0, a dense Qwen3), ``moe_intermediate_size``, ``decoder_sparse_step`` (1), ``mlp_only_layers`` (none) and
    ``tie_word_embeddings`` (False) are optional. ``KeyError`` names a missing key.
    """
    vocab, hidden, d = config["vocab_size"], config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    step, dense_only = config.get("decoder_sparse_step") or 1, tuple(config.get("mlp_only_layers") or ())
    out: list[tuple[str, Shape]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (hidden,)), (p + "self_attn.q_proj.weight", (q, hidden)),
                (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.weight", (kv, hidden)),
                (p + "self_attn.o_proj.weight", (hidden, q)), (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,)), (p + "post_attention_layernorm.weight", (hidden,))]
        if is_sparse_layer(i, experts, step, dense_only):
            width = config["moe_intermediate_size"]
            out.append((p + "mlp.gate.weight", (experts, hidden)))
            for e in range(experts):
                out += _mlp(f"{p}mlp.experts.{e}.", hidden, width)
        else:
            out += _mlp(p + "mlp.", hidden, config["intermediate_size"])
    out.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden)))
    return out


def _mlp(prefix: str, hidden: int, width: int) -> list[tuple[str, Shape]]:
    """A SwiGLU MLP's three matrices (a dense layer's ``mlp.`` or one expert's ``mlp.experts.E.``)."""
    return [(prefix + "gate_proj.weight", (width, hidden)), (prefix + "up_proj.weight", (width, hidden)),
            (prefix + "down_proj.weight", (hidden, width))]
