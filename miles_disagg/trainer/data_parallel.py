"""How a trainer rank wraps its model for data parallelism: FSDP2 per decoder layer on CUDA (bf16
compute, fp32 gradient reduction), DistributedDataParallel over gloo on CPU with several ranks,
the module itself alone. Shared by the policy (:mod:`miles_disagg.trainer.fsdp`) and the critic
(:mod:`miles_disagg.trainer.critic`)."""

from __future__ import annotations

import torch


def wrap_for_data_parallel(module: torch.nn.Module, device: torch.device, world_size: int,
                           *, has_experts: bool) -> torch.nn.Module:
    """``module`` ready to train on ``world_size`` ranks. ``has_experts``: a mixture of experts, where an
    expert no token chose in a step has no gradient (DDP must then not wait for one)."""
    if device.type == "cuda":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in module.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(module, mp_policy=policy)
        return module
    if world_size > 1:
        return torch.nn.parallel.DistributedDataParallel(module, find_unused_parameters=has_experts)
    return module
