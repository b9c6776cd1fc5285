"""A Qwen3-MoE update through the publisher, store, materializer and engine: versions carry the
on-disk expert names; an expert no token chose in a step is not in the version (no payload) and stays
bit-identical on every host; the materialized checkpoint loads in the built-in engine and in
transformers; transformers' fused in-memory experts publish under the same names."""

from __future__ import annotations

import json

import pytest
import torch

from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.config.components import TrainConfig
from miles_disagg.samples import Sample
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.publisher import DeltaPublisher

pytestmark = pytest.mark.timeout(300)


def _routed_to_0_and_1(prompt: list[int], response: list[int]):
    import numpy as np

    routed = np.zeros((len(prompt) + len(response) - 1, 2, 2), dtype=np.int32)
    routed[...] = [0, 1]
    return routed


def _trained_step(model_dir):
    """One fsdp step in which every token is routed to experts 0 and 1 (replay)."""
    from miles_disagg.trainer.fsdp import FSDPBackend

    backend = FSDPBackend(TrainConfig(lr=1e-2, global_batch_size=4, micro_batch_size=4, use_rollout_routing_replay=True),
                          str(model_dir), rank=0, world_size=1)
    samples = [Sample(prompt_ids=[3, 4, 5], response_ids=[6, 7], response_logprobs=[-2.0, -2.0],
                      advantage=float(i % 2) - 0.5, rollout_routed_experts=_routed_to_0_and_1([3, 4, 5], [6, 7]))
               for i in range(4)]
    backend.train([samples])
    return dict(backend.named_tensors())


def test_an_untouched_expert_costs_no_payload_and_stays_bit_identical(tiny_qwen3_moe_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_disagg.engines.builtin.model_runner import ModelRunner

    store = tmp_path / "store"
    publisher = DeltaPublisher(store, base_dir=tiny_qwen3_moe_dir, run_id="moe")
    publisher.capture_baseline()
    trained = _trained_step(tiny_qwen3_moe_dir)
    result = publisher.publish(trained.items())
    index = json.loads(next((store / "weight_v000001").glob("*.index.json")).read_text())
    published = set(index["weight_map"])
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp"
        assert f"{prefix}.experts.0.gate_proj.weight" in published and f"{prefix}.gate.weight" in published
        assert not any(f"{prefix}.experts.{e}." in name for e in (2, 3) for name in published)
    assert not any("gate_up_proj" in name for name in published)
    assert result.num_changed_tensors == len(published) < len(trained)

    host = Materializer(tmp_path / "local", base_dir=tiny_qwen3_moe_dir)
    prepared = host.prepare(store)
    held = load_file(str(prepared.path / "model.safetensors"))
    base = load_file(str(tiny_qwen3_moe_dir / "model.safetensors"))
    assert held.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(held[name], tensor), name
        if ".experts.2." in name or ".experts.3." in name:
            assert torch.equal(held[name], base[name]), name

    runner = ModelRunner(prepared.path)  # the engine loads the version, as does transformers
    ids = torch.tensor([[3, 4, 5, 6]])
    reference = AutoModelForCausalLM.from_pretrained(prepared.path, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (runner.model(ids).logits - reference(input_ids=ids).logits).abs().max() < 1e-5


def test_transformers_fused_experts_publish_under_the_on_disk_names(tiny_qwen3_moe_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_disagg.models.moe_names import on_disk_tensors

    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir, dtype=torch.float32)
    with torch.no_grad():
        model.model.layers[1].mlp.experts.down_proj[3].add_(0.5)  # fused [experts, hidden, width]
    publisher = DeltaPublisher(tmp_path / "store", base_dir=tiny_qwen3_moe_dir, run_id="fused")
    publisher.capture_baseline()
    result = publisher.publish(on_disk_tensors(model.state_dict().items()))
    assert result.num_changed_tensors == 1
    index = json.loads(next((tmp_path / "store" / "weight_v000001").glob("*.index.json")).read_text())
    assert list(index["weight_map"]) == ["model.layers.1.mlp.experts.3.down_proj.weight"]
    prepared = Materializer(tmp_path / "local", base_dir=tiny_qwen3_moe_dir).prepare(tmp_path / "store")
    model.save_pretrained(tmp_path / "saved")
    saved, held = load_file(str(tmp_path / "saved" / "model.safetensors")), load_file(str(prepared.path / "model.safetensors"))
    assert saved.keys() == held.keys()
    assert all(torch.equal(saved[n], held[n]) for n in saved)
