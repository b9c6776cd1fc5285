"""Qwen3 (dense) in plain torch: transformers' parameter names, layout and numerics.

Importing transformers' model classes costs about 5 CPU-seconds per process, more than
everything else a built-in engine or a CPU trainer rank does before its first request. This
module computes what ``transformers.Qwen3ForCausalLM`` computes (float32 RMSNorm, default
RoPE, grouped-query attention through ``scaled_dot_product_attention``, SiLU MLP, optionally
tied embeddings) with the same state-dict names, so checkpoints, version deltas and
``torch.distributed.checkpoint`` saves are interchangeable with it. Integration tests compare
its logits and sampled logprobs with transformers' on the tiny model.

Only configurations this module reproduces exactly are accepted (:func:`native_blocker` names
what stops one); :func:`miles_disagg.models.causal_lm.load_causal_lm` gives transformers the
rest.

The KV cache is a list with one ``(keys, values)`` pair per layer, each ``[rows, kv_heads,
length, head_dim]`` with RoPE applied; ``attention_mask`` covers cached and new tokens
(1 = real token), so rows may be left-padded.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from miles_disagg.config.hf_config import qwen3_values

ARCHITECTURE = "Qwen3ForCausalLM"
LayerCache = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Qwen3Config:
    """The config.json fields the model uses (transformers' names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    pad_token_id: int | None
    bos_token_id: int | None
    eos_token_id: Any

    @classmethod
    def from_dict(cls, config: dict) -> "Qwen3Config":
        """From config.json; keys it leaves out take transformers' ``Qwen3Config`` defaults."""
        values = qwen3_values(config)
        values["rope_theta"] = float(rope_parameters(config).get("rope_theta", values["rope_theta"]))
        return cls(**{f.name: values[f.name] for f in fields(cls)})


def rope_parameters(config: dict) -> dict:
    """config.json's RoPE settings: transformers 5's ``rope_parameters``, else 4's ``rope_scaling``
    ({} when neither is set; ``rope_theta`` may then be a top-level key)."""
    return config.get("rope_parameters") or config.get("rope_scaling") or {}


def native_quantization(config: dict) -> bool:
    """Whether the native model computes the checkpoint's quantization (none, or blockwise FP8)."""
    from miles_disagg.models.fp8 import scheme_of
    from miles_disagg.types import InvalidInput

    try:
        scheme_of(config)
    except InvalidInput:
        return False
    return True


def native_blocker(config: dict) -> str | None:
    """Why this module would not compute what transformers computes for ``config`` (None: it would)."""
    if config.get("architectures") != [ARCHITECTURE] or config.get("model_type") != "qwen3":
        return f"architectures {config.get('architectures')} (model_type {config.get('model_type')!r})"
    checks = {
        "rope_type": rope_parameters(config).get("rope_type", "default") == "default",
        "rope_scaling": not config.get("rope_scaling") or config.get("rope_scaling", {}).get("rope_type") == "default",
        "attention_bias": not config.get("attention_bias", False),
        "hidden_act": config.get("hidden_act", "silu") == "silu",
        "use_sliding_window": not config.get("use_sliding_window", False),
        "layer_types": all(t == "full_attention" for t in config.get("layer_types") or ()),
        "quantization_config": native_quantization(config),
    }
    unsupported = [name for name, ok in checks.items() if not ok]
    return f"config.json sets {unsupported}" if unsupported else None


class Linear(nn.Linear):
    """``nn.Linear`` without a bias and without initialising its weight: every weight is loaded
    from a checkpoint (random initialisation of a large model costs seconds; on the meta device
    it imports TorchDynamo). An ``nn.Linear`` still, so PEFT's LoRA layers wrap it."""

    def __init__(self, in_features: int, out_features: int):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would initialise the weight
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(nn.Module):
    """``nn.Embedding`` without initialising its weight; ``padding_idx``'s row gets no gradient."""

    def __init__(self, num_embeddings: int, dim: int, padding_idx: int | None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim))
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Qwen3RMSNorm: normalised in float32, cast back, then scaled (float32 input:
    torch's fused kernel, the same arithmetic in one call)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with per-head q/k norms and RoPE. The forward reads its
    submodules' weights directly (one module call per layer part, not one per projection)."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim
        self.q_proj = Linear(config.hidden_size, heads * dim)
        self.k_proj = Linear(config.hidden_size, kv_heads * dim)
        self.v_proj = Linear(config.hidden_size, kv_heads * dim)
        self.o_proj = Linear(heads * dim, config.hidden_size)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                past: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        rows, length, _ = x.shape
        shape, eps = (rows, length, -1, self.head_dim), self.q_norm.eps
        q = rms_norm(self.q_proj(x).view(shape), self.q_norm.weight, eps).transpose(1, 2)
        k = rms_norm(self.k_proj(x).view(shape), self.k_norm.weight, eps).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                             enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(rows, length, -1)), (k, v)


class MLP(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past):
        norm, eps = self.input_layernorm, self.input_layernorm.eps
        attended, present = self.self_attn.forward(rms_norm(x, norm.weight, eps), cos, sin, mask, past)
        x = x + attended
        return x + self.mlp.forward(rms_norm(x, self.post_attention_layernorm.weight, eps)), present


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``/``sin`` ``[rows, 1, length, head_dim]`` of the default RoPE, computed in float32."""
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=positions.device).float()
        inv_freq = 1.0 / (self.rope_theta ** (steps / self.head_dim))
        expanded = inv_freq[None, :, None].expand(positions.shape[0], -1, 1)
        freqs = (expanded @ positions[:, None, :].float()).transpose(1, 2)
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # [rows, 1, length, dim]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    cache: LayerCache


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_output_embeddings(self) -> Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: LayerCache | None = None,
                logits_to_keep: int = 0) -> CausalLMOutput:
        """``attention_mask``: ``[rows, cached + new]`` (None: every token is real);
        ``position_ids``: ``[rows, new]`` (None: counting on from the cache's length);
        ``logits_to_keep``: logits of the last N positions only (0: all)."""
        rows, length = input_ids.shape
        past_length = cache[0][0].shape[2] if cache else 0
        if position_ids is None:
            position_ids = torch.arange(past_length, past_length + length, device=input_ids.device).expand(rows, -1)
        hidden = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary(position_ids, hidden.dtype)
        mask = attention_mask_4d(attention_mask, rows, length, past_length, input_ids.device)
        present: LayerCache = []
        for index, layer in enumerate(self.model.layers):
            hidden, kv = layer(hidden, cos, sin, mask, cache[index] if cache else None)
            present.append(kv)
        hidden = self.model.norm(hidden)
        return CausalLMOutput(self.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden), present)


def attention_mask_4d(attention_mask: torch.Tensor | None, rows: int, length: int, past_length: int,
                      device: torch.device) -> torch.Tensor:
    """Boolean ``[rows, 1, length, past + length]``: a query sees the real keys up to its own
    position. A query that would see nothing (a padding row) sees every key, as transformers
    arranges for ``scaled_dot_product_attention``, so that it stays finite; its output is unused."""
    total = past_length + length
    query = torch.arange(past_length, total, device=device)[:, None]
    allowed = (torch.arange(total, device=device)[None, :] <= query)[None, None]
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :total].bool()
    allowed = allowed.expand(rows, 1, length, total)
    return allowed | ~allowed.any(dim=-1, keepdim=True)
