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

Qwen3-MoE (``model_type qwen3_moe``): a sparse layer's router ``mlp.gate.weight`` is the
megatron ``mlp.router.weight`` (``dup``: not split); expert ``E`` 's ``gate_proj``/``up_proj``
and ``down_proj`` are its ``linear_fc1`` (``gated``) and ``linear_fc2`` (``row``). Expert
parallelism (EP) gives EP rank ``k`` the experts ``k * n .. (k + 1) * n - 1`` (``n`` =
experts / EP), numbered from 0 on that rank; a rule's ``ep_owner`` names that rank. Expert
weights are never split over tensor parallelism here (expert TP size 1: each owner holds
whole matrices), so the converter is given TP size 1 for them.

Round trip: ``to_hf(rule, [to_megatron(rule, hf, s, r, tp) for r in range(tp)], s)`` gives
back the HF tensors bit for bit (only slicing and concatenation, never arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from miles_disagg.types import ConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe")
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
    num_experts: int = 0  # 0: a dense model
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[bool, ...] = ()  # per global layer: an MoE layer (empty: none is)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0 and any(self.sparse_layers)

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

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
        moe = _moe_fields(config) if model_type == "qwen3_moe" else {}
        return cls(
            num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
            ffn_hidden_size=config.intermediate_size, num_attention_heads=heads,
            num_query_groups=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            vocab_size=config.vocab_size, max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(theta), norm_eps=config.rms_norm_eps,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)), **moe)

    def check_parallel(self, tp: int, pp: int, ep: int = 1) -> None:
        """``ConfigError`` when heads, groups, FFN, vocab or layers do not divide over TP/PP."""
        for what, value, by, flag_name in (
                ("attention heads", self.num_attention_heads, tp, "--tensor-model-parallel-size"),
                ("key/value heads", self.num_query_groups, tp, "--tensor-model-parallel-size"),
                ("FFN size", self.ffn_hidden_size, tp, "--tensor-model-parallel-size"),
                ("vocab size", self.vocab_size, tp, "--tensor-model-parallel-size"),
                ("layers", self.num_layers, pp, "--pipeline-model-parallel-size"),
                ("experts", self.num_experts, ep, "--expert-model-parallel-size")):
            if value % by:
                raise ConfigError(f"{flag_name} {by} does not divide the model's {what} ({value})", (flag_name,))
        if ep > 1 and not self.is_moe:
            raise ConfigError(f"--expert-model-parallel-size {ep} splits MoE experts, and the checkpoint is a dense "
                              "model: use --expert-model-parallel-size 1", ("--expert-model-parallel-size",))


def _moe_fields(config) -> dict:
    from miles_disagg.config.model_args import sparse_layer_flags

    if getattr(config, "shared_expert_intermediate_size", 0):
        raise ConfigError("--train-backend megatron: shared experts are not supported (Qwen3-MoE has none)",
                          ("--hf-checkpoint",))
    return dict(num_experts=int(config.num_experts), moe_topk=int(config.num_experts_per_tok),
                moe_ffn_hidden_size=int(config.moe_intermediate_size),
                norm_topk_prob=bool(getattr(config, "norm_topk_prob", False)), sparse_layers=sparse_layer_flags(config))


@dataclass(frozen=True)
class ParamRule:
    """One megatron parameter (its name inside this pipeline stage) and the HF tensors it holds.

    ``export`` is False for a copy of a tensor another parameter already exports (the
    output layer of a model with tied embeddings)."""

    megatron: str
    hf: tuple[str, ...]
    kind: str
    export: bool = True
    ep_owner: int | None = None  # an expert's parameter: the expert-parallel rank that holds it

    @property
    def is_expert(self) -> bool:
        return self.ep_owner is not None


def param_rules(shape: ModelShape, layers: range, *, pre_process: bool, post_process: bool,
                fused_norms: bool = False, ep_size: int = 1, grouped_experts: bool = False) -> list[ParamRule]:
    """The rules of one pipeline stage holding global ``layers`` (megatron names count from 0),
    with every expert of every EP rank (filter on ``ep_owner`` for one rank's own).

    ``fused_norms``: Transformer Engine layer specs keep the pre-attention and pre-MLP
    norms inside ``linear_qkv`` / ``linear_fc1`` (``layer_norm_weight``); an MoE layer keeps its
    pre-MLP norm apart (the router reads its output). ``grouped_experts``: Transformer Engine's
    grouped-GEMM experts name expert ``l``'s weights ``linear_fc1.weight{l}``."""
    rules = []
    if pre_process:
        rules.append(ParamRule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "column"))
    for local, layer in enumerate(layers):
        m, h = f"decoder.layers.{local}.", f"model.layers.{layer}."
        if shape.is_sparse(layer):
            rules.extend(_attention_rules(m, h, fused_norms))
            rules.extend(_moe_rules(m, h, shape.num_experts, ep_size, grouped_experts))
        else:
            rules.extend(_layer_rules(m, h, fused_norms))
    if post_process:
        rules.append(ParamRule("decoder.final_layernorm.weight", ("model.norm.weight",), "dup"))
        if not shape.tied_embeddings:
            rules.append(ParamRule("output_layer.weight", ("lm_head.weight",), "column"))
        elif not pre_process:  # the last stage's copy of the tied embedding
            rules.append(ParamRule("output_layer.weight", ("model.embed_tokens.weight",), "column", export=False))
    return rules


def _layer_rules(m: str, h: str, fused_norms: bool) -> list[ParamRule]:
    mlp_norm = m + ("mlp.linear_fc1.layer_norm_weight" if fused_norms else "pre_mlp_layernorm.weight")
    return _attention_rules(m, h, fused_norms) + [
        ParamRule(mlp_norm, (h + "post_attention_layernorm.weight",), "dup"),
        ParamRule(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gated"),
        ParamRule(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
    ]


def _moe_rules(m: str, h: str, num_experts: int, ep_size: int, grouped: bool) -> list[ParamRule]:
    rules = [ParamRule(m + "pre_mlp_layernorm.weight", (h + "post_attention_layernorm.weight",), "dup"),
             ParamRule(m + "mlp.router.weight", (h + "mlp.gate.weight",), "dup")]
    per_rank = num_experts // ep_size
    for expert in range(num_experts):
        owner, local = divmod(expert, per_rank)
        fc1, fc2 = ((f"linear_fc1.weight{local}", f"linear_fc2.weight{local}") if grouped else
                    (f"local_experts.{local}.linear_fc1.weight", f"local_experts.{local}.linear_fc2.weight"))
        e = f"{h}mlp.experts.{expert}."
        rules.append(ParamRule(f"{m}mlp.experts.{fc1}", (e + "gate_proj.weight", e + "up_proj.weight"), "gated",
                               ep_owner=owner))
        rules.append(ParamRule(f"{m}mlp.experts.{fc2}", (e + "down_proj.weight",), "row", ep_owner=owner))
    return rules


def _attention_rules(m: str, h: str, fused_norms: bool) -> list[ParamRule]:
    attn_norm = m + ("self_attention.linear_qkv.layer_norm_weight" if fused_norms else "input_layernorm.weight")
    return [
        ParamRule(attn_norm, (h + "input_layernorm.weight",), "dup"),
        ParamRule(m + "self_attention.linear_qkv.weight",
                  (h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"), "qkv"),
        ParamRule(m + "self_attention.q_layernorm.weight", (h + "self_attn.q_norm.weight",), "dup"),
        ParamRule(m + "self_attention.k_layernorm.weight", (h + "self_attn.k_norm.weight",), "dup"),
        ParamRule(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"),
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
