"""The megatron backend's MoE path on one CUDA GPU: Transformer Engine layers, grouped-GEMM experts
(``--moe-grouped-gemm``: expert ``l``'s weights are ``linear_fc1.weight{l}``), fused permutation,
bf16. The checkpoint round-trips byte for byte through those names, and one step with routing
replay uses the given experts. (Not run in this project's CPU sessions: written, never run.)

GPU-only: skipped with a reason where no CUDA device or Transformer Engine is present. The CPU
path (megatron's own experts, gloo, EP 2) runs in tests/integration/test_megatron_moe.py.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs Transformer Engine (grouped-GEMM experts, fused permutation)"),
]


def test_grouped_gemm_moe_round_trip_logits_and_replay_on_one_gpu(tmp_path) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from tiny_moe import LAYERS, make_tiny_moe

    from miles_disagg.config.components import TrainConfig
    from miles_disagg.distributed import init_distributed
    from miles_disagg.engines.launch import free_port
    from miles_disagg.trainer.megatron.backend import MegatronBackend
    from miles_disagg.samples import Sample

    model_dir = make_tiny_moe(tmp_path / "moe")
    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        config = TrainConfig(train_backend="megatron", moe_grouped_gemm=True, moe_permute_fusion=True,
                             moe_token_dispatcher_type="alltoall", moe_router_dtype="fp32",
                             use_rollout_routing_replay=True, lr=1e-2, global_batch_size=4, micro_batch_size=2)
        backend = MegatronBackend(config, str(model_dir), rank=0, world_size=1)
        assert any(name.endswith("mlp.experts.linear_fc1.weight0") for name, _ in backend.gpt.named_parameters())
        base = load_file(str(model_dir / "model.safetensors"))
        exported = dict(backend.named_tensors())
        assert set(exported) == set(base)
        for name, tensor in base.items():
            assert exported[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name
        batch = []
        for i in range(4):
            sample = Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], response_logprobs=[-3.0] * 3,
                            advantage=float(i % 2) - 0.5)
            routed = np.tile(np.array([3, 2], dtype=np.int32), (5, LAYERS, 1))
            routed[:, 1] = -1
            sample.rollout_routed_experts = routed
            batch.append(sample)
        step = backend.train([batch]).steps[0]
        assert step["train/routing_replay_match"] == 1.0 and 0 <= step["train/routing_agreement"] <= 1
    finally:
        dist.destroy_process_group()
