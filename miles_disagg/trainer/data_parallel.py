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


def unsynced_if(model: torch.nn.Module, skip_sync: bool):
    """A context in which backward does not all-reduce gradients: DDP's ``no_sync`` when ``skip_sync``
    (a micro-batch before the step's last one), else nothing changed."""
    import contextlib

    if skip_sync and isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    return contextlib.nullcontext()


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, clip_grad: float) -> float:
    """Clip the gradients to ``clip_grad`` (0: no clipping), take the optimizer's step; the gradients'
    total norm before clipping (over every rank's shard under FSDP2)."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, clip_grad if clip_grad > 0 else float("inf"))
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    optimizer.step()
    return float(norm)
