"""The engine's routing hooks record the same experts on transformers' Qwen3-MoE (the CUDA path)
as the native model reports, and nothing for a dense model."""

from __future__ import annotations

import json

import torch

from miles_disagg.engines.builtin.routing import routing_capture
from miles_disagg.models.causal_lm import NATIVE, TRANSFORMERS, load_causal_lm
from test_native_qwen3_moe import _checkpoint


def test_transformers_router_hooks_record_what_the_native_model_routes(tmp_path):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path / "moe", mlp_only_layers=[1])
    config = json.loads((path / "config.json").read_text())
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_causal_lm(path)
    capture = routing_capture(theirs, config, TRANSFORMERS)
    native_capture = routing_capture(ours, config, NATIVE)
    ids = torch.tensor([[3, 7, 11, 2, 9], [4, 4, 8, 1, 30]])
    with torch.no_grad(), capture.capturing(ids.shape) as captured, native_capture.capturing(ids.shape) as native:
        theirs(input_ids=ids)
        expected = ours(ids).routed_experts
    assert torch.equal(captured.result(), expected) and torch.equal(native.result(), expected)
    assert (captured.result()[:, :, 1] == -1).all() and (captured.result()[:, :, [0, 2]] >= 0).all()


def test_a_dense_model_has_no_routing(tiny_qwen3_dir):
    config = json.loads((tiny_qwen3_dir / "config.json").read_text())
    assert routing_capture(load_causal_lm(tiny_qwen3_dir), config, NATIVE) is None


def test_a_checkpoint_with_another_routing_rule_is_another_architecture(tmp_path):
    import shutil

    import pytest

    from miles_disagg.engines.builtin.model_runner import ModelRunner
    from miles_disagg.types import InvalidInput

    path = _checkpoint(tmp_path / "moe")
    runner = ModelRunner(path)
    other = tmp_path / "other"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    config["num_experts_per_tok"] = 3  # the same tensors, another model
    (other / "config.json").write_text(json.dumps(config))
    runner.check_compatible(path)
    with pytest.raises(InvalidInput, match="num_experts_per_tok=3"):
        runner.check_compatible(other)
