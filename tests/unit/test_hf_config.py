"""``config.hf_config``: a Qwen3 config.json read without transformers means what AutoConfig makes
of it, for every value the model-flag checks and the Megatron model take from it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_disagg.config.hf_config import QWEN3_MOE_DEFAULTS, qwen3_moe_values, read_hf_config
from miles_disagg.config.model_args import _EXPECTED
from miles_disagg.trainer.megatron.convert import ModelShape

QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
TINY_V5 = {  # as transformers 5 writes it: rope_parameters, no top-level rope_theta
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 16, "hidden_size": 64,
    "intermediate_size": 128, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "vocab_size": 24, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "pad_token_id": 0,
}
PARTIAL = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
           "num_attention_heads": 8, "num_key_value_heads": None}


def _dir(tmp_path: Path, config: dict) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _views(hf) -> dict:
    return {"flags": {name: fn(hf)[0] for name, fn in _EXPECTED.items()}, "shape": ModelShape.from_hf_config(hf),
            "pad": hf.pad_token_id}


@pytest.mark.parametrize("config", [QWEN3_4B, TINY_V5, PARTIAL], ids=["qwen3-4b", "tiny-v5", "partial"])
def test_a_qwen3_config_means_what_autoconfig_makes_of_it(tmp_path: Path, config: dict) -> None:
    from transformers import AutoConfig

    ours = read_hf_config(_dir(tmp_path, config))
    assert isinstance(ours, SimpleNamespace)  # transformers was not asked
    assert _views(ours) == _views(AutoConfig.from_pretrained(str(tmp_path)))


def test_another_model_type_is_transformers_config(tmp_path: Path) -> None:
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
             "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128, "vocab_size": 32}
    assert type(read_hf_config(_dir(tmp_path, llama))).__name__ == "LlamaConfig"


def test_a_broken_file_is_a_value_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{nope")
    with pytest.raises(ValueError):
        read_hf_config(tmp_path)


def test_the_qwen3_moe_defaults_are_transformers() -> None:
    from transformers import Qwen3MoeConfig

    reference = Qwen3MoeConfig()
    values = qwen3_moe_values({})
    expected = {**{key: getattr(reference, key) for key in QWEN3_MOE_DEFAULTS if hasattr(reference, key)},
                "num_experts": getattr(reference, "num_local_experts", None) or reference.num_experts,
                "rope_theta": (reference.rope_parameters or {}).get("rope_theta", 10000.0)}
    assert {key: values[key] for key in expected} == expected
    assert values["head_dim"] == reference.hidden_size // reference.num_attention_heads
    alias = qwen3_moe_values({"num_local_experts": 4, "num_key_value_heads": None, "hidden_size": 64})
    assert (alias["num_experts"], alias["num_key_value_heads"], alias["head_dim"]) == (4, 32, 2)
