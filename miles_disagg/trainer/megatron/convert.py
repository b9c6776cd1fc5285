"""HF Qwen3 <-> megatron-core GPTModel: parameter names, fused layouts and tensor-parallel shards.

Pure tensor code (no torch.distributed). One :class:`ParamRule` per megatron parameter
says which HF tensors it holds and how it is laid out:

- ``dup``: the same tensor on every tensor-parallel (TP) rank (norms).
- ``column`` / ``row``: split along dim 0 / dim 1 over TP ranks (``column`` includes the
  vocab-parallel embedding and output layer).
- ``qkv``: HF ``q_proj``/``k_proj``/``v_proj`` fused per query group: for each group,
  that group's query heads, then its key head, then its value head (rows); TP ranks hold
  whole groups.
- ``gated``: HF ``gate_proj`` and ``up_proj`` fused; each TP rank holds its gate rows
  followed by its up rows.

Round trip: ``to_hf(rule, [to_megatron(rule, hf, s, r, tp) for r in range(tp)], s)`` gives
back the HF tensors bit for bit (only slicing and concatenation, never arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from miles_disagg.types import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3",)
KINDS = ("dup", "column", "row", "qkv", "gated")


@dataclass(frozen=True)
class ModelShape:
    """What the conversion and the megatron model need from an HF Qwen3 config."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    norm_eps: float
    tied_embeddings: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, config) -> "ModelShape":
        """``ConfigError`` for a model this converter does not cover (family, bias, rope scaling)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"--train-backend megatron supports model types {SUPPORTED_MODEL_TYPES}, "
                              f"the checkpoint is {model_type!r}", ("--train-backend", "--hf-checkpoint"))
        if getattr(config, "attention_bias", False):
            raise ConfigError("--train-backend megatron: attention_bias=True is not supported", ("--hf-checkpoint",))
        rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"--train-backend megatron: rope type {rope.get('rope_type')!r} is not supported "
                              "(only unscaled RoPE)", ("--hf-checkpoint",))
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        if theta is None:
            raise ConfigError("the checkpoint's config has no rope_theta", ("--hf-checkpoint",))
        heads = config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size, num_attention_heads=heads,
            num_query_groups=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(theta), norm_eps=config.rms_norm_eps,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    def check_parallel(self, tp: int, pp: int) -> None:
        """``ConfigError`` when heads, groups, FFN, vocab or layers do not divide over TP/PP."""
        for what, value, by, flag_name in (
                ("attention heads", self.num_attention_heads, tp, "--tensor-model-parallel-size"),
                ("key/value heads", self.num_query_groups, tp, "--tensor-model-parallel-size"),
                ("FFN size", self.ffn_hidden_size, tp, "--tensor-model-parallel-size"),
                ("vocab size", self.vocab_size, tp, "--tensor-model-parallel-size"),
                ("layers", self.num_layers, pp, "--pipeline-model-parallel-size")):
            if value % by:
                raise ConfigError(f"{flag_name} {by} does not divide the model's {what} ({value})", (flag_name,))


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter (its name inside this pipeline stage) and the HF tensors it holds.

    ``export`` is False for a copy of a tensor another parameter already exports (the
    output layer of a model with tied embeddings)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    export: bool = True


def param_rules(shape: ModelShape, layers: range, *, pre_process: bool, post_process: bool,
                fused_norms: bool = False) -> list[ParamRule]:
    """The rules of one pipeline stage holding global ``layers`` (megatron names count from 0).

    ``fused_norms``: Transformer Engine layer specs keep the pre-attention and pre-MLP
    norms inside ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``)."""
    rules = []
    if pre_process:
        rules.append(ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"))
    for local, layer in enumerate(layers):
        rules.extend(_layer_rules(f"decoder.layers.{local}.", f"model.layers.{layer}.", fused_norms))
    if post_process:
        rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "dup"))
        if not shape.tied_embeddings:
            rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "column"))
        elif not pre_process:  # the last stage's copy of the tied embedding
            rules.append(ParamRule("output_layer.weight", ("model.embed_tokens.weight",), "column", export=False))
    return rules


def _layer_rules(m: str, h: str, fused_norms: bool) -> list[ParamRule]:
    attn_norm = m + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight")
    mlp_norm = m + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight")
    return [
        ParamRule(attn_norm, (h + "input_layernorm.weight",), "dup"),
        ParamRule(m + "self_attention.linear_qkv.weight",
                  (h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"), "qkv"),
        ParamRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "dup"),
        ParamRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "dup"),
        ParamRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"),
        ParamRule(mlp_norm, (h + "post_attention_layernorm.weight",), "dup"),
        ParamRule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gated"),
        ParamRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
    ]


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The global layers of pipeline stage ``pp_rank`` (an even split, as megatron makes it)."""
    per_stage = num_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def to_megatron(rule: ParamRule, hf: Mapping[str, torch.Tensor], shape: ModelShape, tp_rank: int,
                tp_size: int) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of ``rule``'s parameter, made from the HF tensors it holds."""
    tensors = [hf[name] for name in rule.hf]
    if rule.kind == "dup":
        return tensors[0]
    if rule.kind == "column":
        return tensors[0].chunk(tp_size, dim=0)[tp_rank]
    if rule.kind == "row":
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if rule.kind == "gated":
        gate, up = tensors
        return torch.cat([gate.chunk(tp_size, dim=0)[tp_rank], up.chunk(tp_size, dim=0)[tp_rank]], dim=0)
    if rule.kind == "qkv":
        return _fuse_qkv(*tensors, shape).chunk(tp_size, dim=0)[tp_rank]
    raise ValueError(f"unknown parameter kind {rule.kind!r}; expected one of {KINDS}")


def to_hf(rule: ParamRule, shards: list[torch.Tensor], shape: ModelShape) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of ``rule``'s parameter from its shards on every TP rank (in rank order)."""
    if rule.kind == "dup":
        return [(rule.hf[0], shards[0])]
    if rule.kind == "column":
        return [(rule.hf[0], torch.cat(shards, dim=0))]
    if rule.kind == "row":
        return [(rule.hf[0], torch.cat(shards, dim=1))]
    if rule.kind == "gated":
        halves = [shard.chunk(2, dim=0) for shard in shards]
        gate = torch.cat([h[0] for h in halves], dim=0)
        up = torch.cat([h[1] for h in halves], dim=0)
        return list(zip(rule.hf, (gate, up)))
    if rule.kind == "qkv":
        return list(zip(rule.hf, _split_qkv(torch.cat(shards, dim=0), shape)))
    raise ValueError(f"unknown parameter kind {rule.kind!r}; expected one of {KINDS}")


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    groups, head_dim = shape.num_query_groups, shape.head_dim
    q = q.reshape(groups, shape.heads_per_group * head_dim, -1)
    k = k.reshape(groups, head_dim, -1)
    v = v.reshape(groups, head_dim, -1)
    return torch.cat([q, k, v], dim=1).reshape(-1, q.shape[-1])


def _split_qkv(fused: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, head_dim = shape.num_query_groups, shape.head_dim
    q_rows = shape.heads_per_group * head_dim
    per_group = fused.reshape(groups, q_rows + 2 * head_dim, -1)
    q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
    hidden = fused.shape[-1]
    return (q.reshape(-1, hidden).contiguous(), k.reshape(-1, hidden).contiguous(),
            v.reshape(-1, hidden).contiguous())
