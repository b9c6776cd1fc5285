"""The fsdp backend on a CUDA device (FSDP2 ``fully_shard``, nccl, bf16 compute).

GPU-only: skipped with a reason where no CUDA device is present. The CPU path of the same
backend (gloo data parallelism) runs in tests/integration/test_trainer_group.py and the e2e runs.
"""

from __future__ import annotations

import pytest
import torch

from miles_disagg.config.components import TrainConfig
from miles_disagg.types import Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_fsdp2_step_and_export_on_one_gpu(tiny_qwen3_dir, monkeypatch) -> None:
    import torch.distributed as dist
    from safetensors import safe_open

    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.fsdp import FSDPBackend

    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        backend = FSDPBackend(TrainConfig(lr=1e-2, global_batch_size=4, micro_batch_size=2), str(tiny_qwen3_dir),
                              rank=0, world_size=1)
        batch = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], response_logprobs=[-4.6] * 3,
                        advantage=float(i % 2) - 0.5) for i in range(4)]
        metrics = backend.train([batch])
        assert metrics["train/ppo_kl_first_minibatch"] == pytest.approx(0.0, abs=1e-3)  # bf16 compute
        exported = dict(backend.named_tensors())
        with safe_open(str(next(tiny_qwen3_dir.glob("*.safetensors"))), "pt") as f:
            assert set(exported) == set(f.keys())
            for name in f.keys():
                base = f.get_tensor(name)
                assert exported[name].device.type == "cpu" and exported[name].dtype == base.dtype
                assert exported[name].shape == base.shape
    finally:
        dist.destroy_process_group()
