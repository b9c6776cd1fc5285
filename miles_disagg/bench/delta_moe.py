"""The MoE-shaped model and update of ``miles-disagg bench delta --moe``.

Model: Qwen3-30B-A3B's proportions scaled to the requested size (3 layers, GQA attention, a router
``mlp.gate`` ``[experts, hidden]`` and per-expert ``gate_proj``/``up_proj``/``down_proj`` of width
``3/8 x hidden``, the checkpoint's on-disk names), bf16 N(0, 0.02).

Update: one optimizer step in which ``tokens`` tokens are routed top-``k`` over the experts with a
skewed load (each layer's expert popularity drawn from a Dirichlet(0.3), as routers are uneven early
in training). An expert that received at least one token takes an AdamW step as in the dense
bench (every element moves by ``lr`` in the gradient's sign, weight decay 0.1, re-rounded to bf16);
one that received none has no gradient and is bit-identical (AdamW skips parameters without one).
The router, attention, norms, embeddings and head all take a step.
"""

from __future__ import annotations

import math

import numpy as np

from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes

MOE_LAYERS = 3
WIDTH_RATIO = 0.375  # moe_intermediate_size / hidden_size in Qwen3-30B-A3B (768 / 2048)


def moe_shapes(size_bytes: int, experts: int) -> list[tuple[str, tuple[int, ...]]]:
    """bf16 shapes of a 3-layer Qwen3-MoE (heads of 16, GQA 4:1) whose total is close to ``size_bytes``."""
    per_h2 = 2 * (2 * 16 + MOE_LAYERS * (2.5 + 3 * WIDTH_RATIO * experts))  # bytes per hidden^2
    hidden = max(64, int(round(math.sqrt(size_bytes / per_h2) / 64)) * 64)
    width = max(8, int(hidden * WIDTH_RATIO) // 8 * 8)
    return qwen3_tensor_shapes({"vocab_size": hidden * 16, "hidden_size": hidden, "num_hidden_layers": MOE_LAYERS,
                                "head_dim": 16, "num_attention_heads": hidden // 16, "num_key_value_heads": hidden // 64,
                                "num_experts": experts, "moe_intermediate_size": width})


def experts_hit(experts: int, top_k: int, tokens: int, rng: np.random.Generator) -> set[int]:
    """The experts of one layer that at least one of ``tokens`` tokens was routed to (top-k, skewed load)."""
    popularity = rng.dirichlet(np.full(experts, 0.3))
    hit: set[int] = set()
    for _ in range(tokens):
        hit.update(rng.choice(experts, size=top_k, replace=False, p=popularity).tolist())
    return hit


def make_moe_model(size_mb: float, lr: float, seed: int, experts: int, top_k: int, tokens: int
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict]:
    """(old, new, routing summary): bf16 byte arrays per tensor before and after the step."""
    import torch

    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    hit = {layer: experts_hit(experts, top_k, tokens, rng) for layer in range(MOE_LAYERS)}
    old, new = {}, {}
    for name, shape in moe_shapes(int(size_mb * 1024 * 1024), experts):
        master = torch.randn(shape, generator=gen) * 0.02
        if name.endswith("norm.weight"):
            master += 1.0
        old[name] = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
        if _untouched(name, hit):
            new[name] = old[name].copy()
            continue
        sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int8).float().mul_(2).sub_(1)
        master.sub_(lr * (sign + 0.1 * master))
        new[name] = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
    summary = {"num_experts": experts, "experts_per_token": top_k, "tokens_per_step": tokens,
               "experts_without_tokens": sum(experts - len(h) for h in hit.values()),
               "expert_slots": experts * MOE_LAYERS}
    return old, new, summary


def _untouched(name: str, hit: dict[int, set[int]]) -> bool:
    parts = name.split(".")
    if "experts" not in parts:
        return False
    layer, expert = int(parts[2]), int(parts[parts.index("experts") + 1])
    return expert not in hit[layer]
