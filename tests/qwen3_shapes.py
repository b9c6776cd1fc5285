"""Random Qwen3 / Qwen3-MoE checkpoint tensors for a megatron ``ModelShape`` (conversion tests)."""

from __future__ import annotations

from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes


def hf_config_of(shape) -> dict:
    """The config.json keys of the Qwen3 (or Qwen3-MoE) a ``ModelShape`` describes."""
    config = {"vocab_size": shape.vocab_size, "hidden_size": shape.hidden_size,
              "intermediate_size": shape.ffn_hidden_size, "num_hidden_layers": shape.num_layers,
              "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_query_groups,
              "head_dim": shape.head_dim, "tie_word_embeddings": shape.tied_embeddings}
    if shape.num_experts:
        config.update(num_experts=shape.num_experts, moe_intermediate_size=shape.moe_ffn_hidden_size,
                      mlp_only_layers=[i for i in range(shape.num_layers) if not shape.is_sparse(i)])
    return config


def hf_tensors(shape, dtype=None) -> dict:
    """Random HF-named tensors with the checkpoint's shapes (distinct values, so a misplaced row
    shows); float32 unless ``dtype``."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(s, generator=generator).to(dtype or torch.float32)
            for name, s in qwen3_tensor_shapes(hf_config_of(shape))}
