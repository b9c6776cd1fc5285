"""``miles-disagg make-tiny-checkpoint --num-experts``: a Qwen3-MoE that transformers loads, with
the on-disk expert names; the native model computes what transformers does on it."""

from __future__ import annotations

import json

import pytest

from test_make_tiny_checkpoint import cli, refused

pytestmark = pytest.mark.timeout(300)


def test_writes_a_moe_checkpoint_transformers_loads(tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_disagg.models.causal_lm import load_causal_lm

    out = tmp_path / "moe"
    proc = cli("--out", str(out), "--num-experts", "4", "--num-experts-per-tok", "2", "--moe-intermediate-size", "24")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert (summary["num_experts"], summary["num_experts_per_tok"], summary["moe_intermediate_size"]) == (4, 2, 24)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["architectures"] == ["Qwen3MoeForCausalLM"]
    assert config["num_experts"] == 4 and "num_local_experts" not in config  # released checkpoints' key
    names = set(load_file(out / "model.safetensors"))
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.1.mlp.experts.3.up_proj.weight" in names
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (model.config.num_experts, model.config.num_experts_per_tok, model.config.moe_intermediate_size) == (4, 2, 24)
    native = load_causal_lm(out)
    ids = torch.tensor([[3, 14, 15, 9, 26, 5]])
    with torch.no_grad():
        assert (native(ids).logits - model(ids).logits).abs().max() < 1e-5


def test_impossible_expert_shapes_are_refused(tmp_path):
    refused("--out", str(tmp_path / "a"), "--num-experts", "2", "--num-experts-per-tok", "3",
            match="--num-experts-per-tok")
    refused("--out", str(tmp_path / "b"), "--num-experts", "-1", match="--num-experts")
