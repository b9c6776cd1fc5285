"""Optimizers of the megatron backend: a plain torch AdamW on CPU, megatron's distributed optimizer on GPU.

Both expose the same small surface to the backend: ``model`` (what forward passes call),
``no_sync`` (a context that defers gradient reduction, or None), ``zero_grad()``,
``step() -> grad_norm`` (reduce gradients over ranks, clip to ``--clip-grad``, update)
and ``state_dict()`` / ``load_state_dict()``. ``step`` is collective over all ranks.

The CPU optimizer reduces gradients as megatron's ``finalize_model_grads`` does for the
layouts a CPU run allows (TP and DP; the backend rejects PP, CP and sequence parallelism
on CPU): averaged over data-parallel ranks, and summed over tensor-parallel ranks for the
QK-norm weights (each TP rank's attention sees only its own heads).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from miles_disagg.config.components import TrainConfig


class CpuOptimizer:
    """AdamW on the rank's own parameters (megatron's optimizers allocate CUDA tensors)."""

    no_sync = None

    def __init__(self, model: torch.nn.Module, config: TrainConfig):
        self.model = model
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                                           eps=config.adam_eps, weight_decay=config.weight_decay)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        self._reduce_grads()
        norm = global_grad_norm(self.model)
        if self.config.clip_grad > 0 and norm > self.config.clip_grad:
            scale = self.config.clip_grad / (norm + 1e-6)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        self.optimizer.step()
        return norm

    def _reduce_grads(self) -> None:
        from megatron.core import parallel_state as ps

        for p in self.params:
            if p.grad is None:  # every rank must join every all-reduce
                p.grad = torch.zeros_like(p)
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(dp_cp) > 1:
            for p in self.params:
                dist.all_reduce(p.grad, group=dp_cp)
                p.grad.div_(dist.get_world_size(dp_cp))
        tp = ps.get_tensor_model_parallel_group()
        if dist.get_world_size(tp) > 1:
            for name, p in self.model.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    dist.all_reduce(p.grad, group=tp)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def global_grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the whole model's gradient: TP shards counted once each, TP-duplicated weights
    once (on TP rank 0), the tied output-layer copy not at all; summed over TP and PP ranks."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    total = torch.zeros(1, dtype=torch.float64)
    for p in model.parameters():
        if p.grad is None or getattr(p, "shared", False):
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        total += p.grad.detach().double().pow(2).sum().cpu()
    model_parallel = ps.get_model_parallel_group()
    if dist.get_world_size(model_parallel) > 1:
        dist.all_reduce(total, group=model_parallel)
    return math.sqrt(total.item())


class GpuOptimizer:
    """megatron's DistributedDataParallel (fp32 gradient buffers unless --no-accumulate-allreduce-grads-in-fp32)
    and distributed optimizer (fp32 main weights sharded over data-parallel ranks, bf16 model weights)."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, tconfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        fp32_grads = config.accumulate_allreduce_grads_in_fp32 is not False  # miles' flag; unset: on
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=fp32_grads, use_distributed_optimizer=True,
                                                   overlap_grad_reduce=False)
        self.model = DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=model)
        self.no_sync = self.model.no_sync
        opt_config = OptimizerConfig(
            optimizer="adam", lr=config.lr, min_lr=config.lr, weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1, adam_beta2=config.adam_beta2, adam_eps=config.adam_eps,
            clip_grad=config.clip_grad, bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=True)
        self.optimizer = get_megatron_optimizer(opt_config, [self.model])
        self.lr = config.lr

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self.model])
        updated, grad_norm, _ = self.optimizer.step()
        if not updated:
            raise FloatingPointError("the optimizer skipped the step (non-finite gradients)")
        return float(grad_norm)

    def state_dict(self) -> dict:
        """This rank's shard: each inner optimizer's own state and its slice of the fp32 main
        weights and Adam moments (no collective; reload with the same parallel layout)."""
        return {"optimizers": [{"state": o.state_dict(), "param_state": o.get_parameter_state_dp_reshardable()}
                               for o in self._inner()]}

    def load_state_dict(self, state: dict) -> None:
        for optimizer, saved in zip(self._inner(), state["optimizers"], strict=True):
            optimizer.load_state_dict(saved["state"])
            optimizer.load_parameter_state_from_dp_reshardable(saved["param_state"])

    def _inner(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))


def make_optimizer(model: torch.nn.Module, config: TrainConfig, tconfig):
    """The CPU or GPU optimizer for ``model`` (a GPTModel stage)."""
    if torch.cuda.is_available():
        return GpuOptimizer(model, config, tconfig)
    return CpuOptimizer(model, config)
