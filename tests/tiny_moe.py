"""A random tiny Qwen3-MoE checkpoint for tests, made with transformers' ``Qwen3MoeForCausalLM``
(its ``save_pretrained`` writes the on-disk per-expert names the engines read). Until the
project's own maker takes ``num_experts`` (``make-tiny-checkpoint --num-experts``), tests use this."""

from __future__ import annotations

from pathlib import Path

import torch

LAYERS, EXPERTS, TOPK = 3, 4, 2


def make_tiny_moe(out: Path, seed: int = 0, charset: str | None = None, std: float = 0.3) -> Path:
    """Layers 0 and 2 sparse (4 experts, top 2, renormalized), layer 1 dense (``mlp_only_layers``), float32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from miles_disagg.models.tiny_qwen3 import build_tokenizer

    tokenizer = build_tokenizer(charset) if charset else build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
        num_experts_per_tok=TOPK, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=128, rope_theta=10000.0, tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(config).float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return Path(out)
