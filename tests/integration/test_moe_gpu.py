"""Qwen3-MoE on a CUDA device: the built-in engine (transformers' model, bf16) records routed experts
through its router hooks, and one FSDP2 step replays the engine's routing.

GPU-only: skipped with a reason where no CUDA device is present (the same code paths run on CPU with
transformers' model forced in tests/integration/test_fsdp_moe_replay.py and
tests/unit/test_engine_routing_capture.py)."""

from __future__ import annotations

import pytest
import torch

from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.config.components import TrainConfig
from miles_disagg.models.routed_experts_wire import decode_routed_experts
from miles_disagg.samples import Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_engine_on_cuda_returns_routed_experts_and_fsdp2_replays_them(tiny_qwen3_moe_dir) -> None:
    import torch.distributed as dist

    from engine_fixtures import inprocess_engine
    from miles_disagg.distributed import init_distributed
    from miles_disagg.engines.launch import free_port
    from miles_disagg.trainer.fsdp import FSDPBackend

    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    with inprocess_engine(tiny_qwen3_moe_dir, device="cuda", dtype="float32",
                          enable_return_routed_experts=True) as (engine, handle):
        assert engine.runner.implementation == "transformers"
        results = handle.generate({"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
                                   "sampling_params": {"max_new_tokens": 6, "ignore_eos": True}})
    samples = []
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        routed = decode_routed_experts(result["meta_info"]["routed_experts"], 2, 2)
        assert routed.shape == (len(prompt) + len(result["output_ids"]) - 1, 2, 2)
        samples.append(Sample(prompt_ids=prompt, response_ids=result["output_ids"], advantage=float(i) - 0.5,
                              response_logprobs=[t[0] for t in result["meta_info"]["output_token_logprobs"]],
                              rollout_routed_experts=routed.copy()))
    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        backend = FSDPBackend(TrainConfig(lr=1e-3, global_batch_size=2, micro_batch_size=2,
                                          use_rollout_routing_replay=True), str(tiny_qwen3_moe_dir),
                              rank=0, world_size=1)
        step = backend.train([samples]).steps[0]
        assert step["train/routing_replay_match"] == 1.0
        names = {name for name, _ in backend.named_tensors()}
        assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and not any("gate_up" in n for n in names)
    finally:
        dist.destroy_process_group()
