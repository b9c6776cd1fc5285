"""Qwen3-MoE in plain torch: transformers' ``Qwen3MoeForCausalLM`` numerics, the on-disk names.

Attention, norms, RoPE and the dense MLP are :mod:`miles_disagg.models.qwen3`'s. A sparse layer
(HF's rule: ``i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0``)
has a router ``mlp.gate`` (``[num_experts, hidden]``, no bias) and ``num_experts`` SwiGLU
experts kept one module each, so the state dict has the on-disk names SGLang, safetensors
checkpoints and version deltas use (``mlp.experts.E.{gate,up,down}_proj.weight``), not
transformers 5's fused in-memory ``mlp.experts.gate_up_proj`` (see
:mod:`miles_disagg.models.moe_names` for the conversion of a transformers model's tensors).

Router (HF): ``probs = softmax(x @ gate.T, float32)``, top-k by probability, renormalised to sum 1
if ``norm_topk_prob``, cast back to the activations' dtype; output ``sum_k w_k * expert_k(x)``.

Routing replay: ``forward(..., routing=R)`` with ``R`` int ``[rows, new_tokens, num_hidden_layers,
top_k]`` routes token ``t`` of a sparse layer ``l`` to the experts ``R[row, t, l]`` unless that row
holds a -1 (then the router chooses freely); the weights are still the router's own probabilities
gathered at those experts (renormalised likewise), so the router gets its gradient. Every forward
returns ``routed_experts``: the experts each token went to, same shape, -1 on dense layers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.nn import functional as F

from miles_disagg.config.hf_config import qwen3_moe_values
from miles_disagg.models.qwen3 import (
    MLP, Attention, CausalLMOutput, Embedding, LayerCache, Linear, Qwen3Config, Qwen3Model, RMSNorm,
    attention_mask_4d, native_blocker as dense_blocker, rms_norm, rope_parameters,
)
from miles_disagg.models.qwen3_tensors import is_sparse_layer

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class Qwen3MoeConfig(Qwen3Config):
    """The config.json fields the model uses (transformers' names): :class:`Qwen3Config`'s and the experts'."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    router_aux_loss_coef: float

    @classmethod
    def from_dict(cls, config: dict) -> "Qwen3MoeConfig":
        """From config.json; keys it leaves out take transformers' ``Qwen3MoeConfig`` defaults."""
        values = qwen3_moe_values(config)
        values["rope_theta"] = float(rope_parameters(config).get("rope_theta", values["rope_theta"]))
        values["mlp_only_layers"] = tuple(values.get("mlp_only_layers") or ())
        return cls(**{f.name: values[f.name] for f in fields(cls)})

    def is_sparse(self, layer: int) -> bool:
        """HF's rule for a layer with experts."""
        return is_sparse_layer(layer, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    @property
    def sparse_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_sparse(i)]


def is_moe_config(config: dict) -> bool:
    return config.get("model_type") == MODEL_TYPE


def native_blocker(config: dict) -> str | None:
    """Why this module would not compute what transformers computes for ``config`` (None: it would)."""
    if config.get("architectures") != [ARCHITECTURE] or not is_moe_config(config):
        return f"architectures {config.get('architectures')} (model_type {config.get('model_type')!r})"
    as_dense = {**config, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    blocker = dense_blocker(as_dense)
    if blocker:
        return blocker
    if config.get("output_router_logits"):
        return "config.json sets ['output_router_logits']"
    return None


class Expert(MLP):
    """One SwiGLU expert (``gate_proj``, ``up_proj``, ``down_proj``) of width ``moe_intermediate_size``."""

    def __init__(self, hidden_size: int, width: int):
        nn.Module.__init__(self)
        self.gate_proj = Linear(hidden_size, width)
        self.up_proj = Linear(hidden_size, width)
        self.down_proj = Linear(width, hidden_size)


@dataclass
class Routing:
    """A sparse layer's choice for ``tokens`` flattened tokens: expert indices and their weights."""

    experts: torch.Tensor  # [tokens, top_k] long: the experts used
    weights: torch.Tensor  # [tokens, top_k] activations' dtype
    own: torch.Tensor  # [tokens, top_k] long: the router's own top-k (differs from experts where replayed)


class SparseMoeBlock(nn.Module):
    """Router ``gate`` plus ``experts``; see the module docstring for the routing rule."""

    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Linear(config.hidden_size, config.num_experts)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))

    def route(self, x: torch.Tensor, forced: torch.Tensor | None) -> Routing:
        """``x`` ``[tokens, hidden]``; ``forced`` ``[tokens, top_k]`` (rows holding -1: free)."""
        probs = torch.softmax(F.linear(x, self.gate.weight), dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        own = experts
        if forced is not None:
            replay = (forced >= 0).all(dim=-1)
            experts = torch.where(replay[:, None], forced.to(experts.dtype).clamp(min=0), experts)
            top = probs.gather(-1, experts)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(experts, top.to(x.dtype), own)

    def forward(self, x: torch.Tensor, forced: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` ``[rows, length, hidden]``; returns the output, the experts used and the router's own
        top-k (each ``[rows, length, top_k]``)."""
        rows, length, hidden = x.shape
        flat = x.reshape(-1, hidden)
        routing = self.route(flat, None if forced is None else forced.reshape(-1, self.top_k))
        out = torch.zeros_like(flat)
        for expert in torch.unique(routing.experts).tolist():  # only the experts some token chose
            tokens, slot = torch.where(routing.experts == expert)
            computed = self.experts[expert](flat[tokens]) * routing.weights[tokens, slot, None]
            out.index_add_(0, tokens, computed.to(out.dtype))
        shape = (rows, length, self.top_k)
        return out.reshape(rows, length, hidden), routing.experts.reshape(shape), routing.own.reshape(shape)


class MoeDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3MoeConfig, index: int):
        super().__init__()
        self.sparse = config.is_sparse(index)
        self.self_attn = Attention(config)
        self.mlp = SparseMoeBlock(config) if self.sparse else MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past, forced: torch.Tensor | None):
        """Returns ``(hidden, kv, (experts used, router's own top-k) or None)``."""
        norm, eps = self.input_layernorm, self.input_layernorm.eps
        attended, present = self.self_attn.forward(rms_norm(x, norm.weight, eps), cos, sin, mask, past)
        x = x + attended
        normed = rms_norm(x, self.post_attention_layernorm.weight, eps)
        if not self.sparse:
            return x + self.mlp.forward(normed), present, None
        out, experts, own = self.mlp(normed, forced)  # a module call: forward hooks see the routing
        return x + out, present, (experts, own)


class Qwen3MoeModel(Qwen3Model):
    def __init__(self, config: Qwen3MoeConfig):
        nn.Module.__init__(self)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MoeDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta


@dataclass
class MoeCausalLMOutput(CausalLMOutput):
    routed_experts: torch.Tensor | None = None
    """int32 ``[rows, new_tokens, num_hidden_layers, top_k]``: each token's experts, -1 on dense layers."""
    router_choice: torch.Tensor | None = None
    """Same shape: the router's own top-k (equal to ``routed_experts`` except where a routing was replayed)."""


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, config: Qwen3MoeConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3MoeModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: LayerCache | None = None,
                logits_to_keep: int = 0, routing: torch.Tensor | None = None) -> MoeCausalLMOutput:
        """As :meth:`Qwen3ForCausalLM.forward`, plus ``routing``: experts to replay (module docstring)."""
        rows, length = input_ids.shape
        past_length = cache[0][0].shape[2] if cache else 0
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=input_ids.device).expand(rows, -1)
        if routing is not None and tuple(routing.shape[:3]) != (rows, length, self.config.num_hidden_layers):
            raise ValueError(f"routing has shape {tuple(routing.shape)}, expected "
                             f"[{rows}, {length}, {self.config.num_hidden_layers}, {self.config.num_experts_per_tok}]")
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(position_ids, hidden.dtype)
        mask = attention_mask_4d(attention_mask, rows, length, past_length, input_ids.device)
        routed = torch.full((rows, length, self.config.num_hidden_layers, self.config.num_experts_per_tok), -1,
                            dtype=torch.int32, device=input_ids.device)
        own = routed.clone()
        present: LayerCache = []
        for index, layer in enumerate(self.model.layers):
            forced = routing[:, :, index] if routing is not None and layer.sparse else None
            hidden, kv, choice = layer(hidden, cos, sin, mask, cache[index] if cache else None, forced)
            if choice is not None:
                routed[:, :, index], own[:, :, index] = choice[0].to(torch.int32), choice[1].to(torch.int32)
            present.append(kv)
        hidden = self.model.norm(hidden)
        logits = self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)
        return MoeCausalLMOutput(logits, present, routed, own)
