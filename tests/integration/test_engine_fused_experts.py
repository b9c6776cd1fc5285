"""The built-in engine on transformers' Qwen3-MoE (its CUDA path, forced onto the CPU here), whose
experts are fused parameters: versions, checksums and weight updates still name one matrix per expert
(the checkpoint's names). A pulled delta that changes a few experts is swapped in exactly (checksums
equal the publisher's; logits equal transformers' on the materialized checkpoint); routed experts are
recorded through the router hooks; a tensor update of one expert changes only that expert."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine_fixtures import inprocess_engine
from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.models.routed_experts_wire import decode_routed_experts

pytestmark = pytest.mark.timeout(300)
EXPERT = "model.layers.1.mlp.experts.2.up_proj.weight"


@pytest.fixture
def transformers_engine(tiny_qwen3_moe_dir, tmp_path, monkeypatch):
    from miles_disagg.engines.builtin import model_runner
    from miles_disagg.models import causal_lm
    from miles_disagg.weights.publisher import DeltaPublisher

    forced = lambda *_a, **_k: (causal_lm.TRANSFORMERS, "test")  # noqa: E731
    monkeypatch.setattr(causal_lm, "implementation", forced)
    monkeypatch.setattr(model_runner, "implementation", forced)
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3_moe_dir, model)
    store, local = tmp_path / "store", tmp_path / "local"
    publisher = DeltaPublisher(store, base_dir=model)
    publisher.capture_baseline()
    with inprocess_engine(model, weight_store_dirs=[store], local_checkpoint_dir=local,
                          enable_return_routed_experts=True) as (engine, handle):
        assert engine.runner.implementation == "transformers"
        assert any(name.endswith("mlp.experts.gate_up_proj") for name in engine.runner.params)
        yield engine, handle, publisher, store, local


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_checksums_name_the_checkpoints_tensors(transformers_engine, tiny_qwen3_moe_dir):
    _engine, handle, publisher, _store, _local = transformers_engine
    served = handle.get("/weight_checksums").json()["checksums"]
    assert served == publisher.published_checksums()
    assert set(served) == set(_checkpoint(tiny_qwen3_moe_dir))


def test_a_pulled_delta_of_a_few_experts_is_swapped_in_exactly(transformers_engine):
    from transformers import AutoModelForCausalLM

    engine, handle, publisher, store, local = transformers_engine
    tensors = _checkpoint(engine.config.model_path)
    changed = [EXPERT, "model.layers.0.mlp.experts.0.down_proj.weight", "model.layers.0.mlp.gate.weight"]
    generator = torch.Generator().manual_seed(1)
    for name in changed:
        tensors[name] = tensors[name] + 0.3 * torch.randn(tensors[name].shape, generator=generator)
    version = publisher.publish(tensors.items()).ref.version
    assert handle.post("/pull_weights", {"target_version": version, "source_dir": str(store)}).status_code == 200
    response = handle.post("/update_weights_from_disk", {"model_path": str(local), "weight_version": str(version)})
    assert response.status_code == 200, response.text
    assert handle.get("/weight_checksums").json()["checksums"] == publisher.published_checksums()
    reference = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    tokens = [3, 4, 5, 6, 7]
    with torch.no_grad():
        expected = torch.log_softmax(reference(input_ids=torch.tensor([tokens])).logits[0].float(), -1)
    assert (engine.runner.full_logprobs(tokens) - expected).abs().max() < 1e-5


def test_routed_experts_come_from_the_router_hooks(transformers_engine):
    engine, handle, *_ = transformers_engine
    result = handle.generate({"input_ids": [4, 5, 6], "return_routed_experts": True,
                              "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    routed = decode_routed_experts(result["meta_info"]["routed_experts"], 2, 2)
    tokens = [4, 5, 6] + result["output_ids"]
    assert (routed == engine.runner.full_routed_experts(tokens)[:-1].numpy()).all()
    assert routed.shape == (len(tokens) - 1, 2, 2)


def test_a_tensor_update_of_one_expert_changes_only_that_expert(transformers_engine):
    from miles_disagg.engines.tensor_transfer import serialize_named_tensors

    engine, handle, *_ = transformers_engine
    before = {n: t.clone() for n, t in engine.runner.named_weights().items()}
    new = torch.full(before[EXPERT].shape, 0.25)
    body = {"serialized_named_tensors": [serialize_named_tensors([(EXPERT, new)])]}
    assert handle.post("/update_weights_from_tensor", body).status_code == 200
    after = engine.runner.named_weights()
    for name, tensor in before.items():
        assert torch.equal(after[name], new if name == EXPERT else tensor), name
