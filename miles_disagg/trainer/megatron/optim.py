"""Optimizers of the megatron backend: a plain torch AdamW on CPU, megatron's distributed optimizer on GPU.

Both expose the same small surface to the backend: ``model`` (what forward passes call),
``no_sync`` (a context that defers gradient reduction, or None), ``zero_grad()``,
``step() -> grad_norm`` (reduce gradients over ranks, clip to ``--clip-grad``, update),
and for checkpoints ``sharded_state_dict(model_sharded, is_loading)`` (megatron-core
``dist_checkpointing`` entries that reshard between TP/DP layouts) and
``load_sharded_state_dict(loaded)``. ``step`` is collective over all ranks.

The CPU optimizer reduces gradients as megatron's ``finalize_model_grads`` does for the
layouts a CPU run allows (TP, DP and EP; the backend rejects PP, CP and sequence parallelism
on CPU): averaged over data-parallel ranks, and summed over tensor-parallel ranks for the
QK-norm weights (each TP rank's attention sees only its own heads). An MoE expert's
gradient already holds every token routed to it from its EP group (the all-to-all's
backward brings them), so it is summed over the expert's replicas (the expert-data-parallel
group) and divided by the data-parallel size, as megatron's DDP scales expert gradients.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from miles_disagg.config.training import TrainConfig


class CpuOptimizer:
    """AdamW on the rank's own parameters (megatron's optimizers allocate CUDA tensors)."""

    no_sync = None

    def __init__(self, model: torch.nn.Module, config: TrainConfig):
        self.model = model
        self.config = config
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.expert_params = {name for name, _ in model.named_parameters() if is_expert_param(name)}
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
        replicas = dist.get_world_size(dp_cp)
        expert_dp = ps.get_expert_data_parallel_group() if self.expert_params else None
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            group = expert_dp if name in self.expert_params else dp_cp
            if dist.get_world_size(group) > 1:
                dist.all_reduce(p.grad, group=group)
            if replicas > 1:
                p.grad.div_(replicas)
        tp = ps.get_tensor_model_parallel_group()
        if dist.get_world_size(tp) > 1:
            for name, p in self.model.named_parameters():
                if "q_layernorm" in name or "k_layernorm" in name:
                    dist.all_reduce(p.grad, group=tp)

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        """AdamW's state as megatron ``dist_checkpointing`` entries.

        A plain torch optimizer has no sharded state dict of its own, but its per-parameter
        state has each parameter's shape, so every moment (``exp_avg``, ``exp_avg_sq``) is
        declared with its parameter's own sharding (its key prefixed with
        ``optimizer.state.<moment>.``; TP splits, the SwiGLU split and replica ids as the
        parameter's), using megatron-core's optimizer helpers. The checkpoint then holds
        global tensors and reshards between TP and DP layouts exactly as the model does.
        The step count, equal for every parameter (each step updates every parameter:
        ``_reduce_grads`` gives missing gradients zeros), and the hyperparameters are common
        state. ``is_loading``: a fresh optimizer first gets zero state to load into."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map, optim_state_to_sharding_state)

        if is_loading:
            self._create_state()
        state = self.optimizer.state_dict()
        steps = {float(per_param["step"]) for per_param in state["state"].values()}
        if len(steps) > 1:
            raise RuntimeError(f"optimizer step counts differ between parameters: {sorted(steps)}")
        sharded = {"state": {index: {k: v for k, v in per_param.items() if k != "step"}  # copies: not the live dicts
                             for index, per_param in state["state"].items()},
                   "param_groups": state["param_groups"]}
        optim_state_to_sharding_state(sharded, get_param_id_to_sharded_param_map(model_sharded, self.params))
        sharded["step"] = steps.pop() if steps else 0.0
        return sharded

    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Restore the optimizer from what ``dist_checkpointing.load`` returned for
        ``sharded_state_dict(..., is_loading=True)``."""
        step = loaded.pop("step")
        for per_param in loaded["state"].values():
            per_param["step"] = torch.tensor(step, dtype=torch.float32)
        self.optimizer.load_state_dict(loaded)

    @torch.no_grad()
    def _create_state(self) -> None:
        create_adam_state(self.optimizer)


def create_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh torch Adam(W) its per-parameter state (step, moments) to load a checkpoint
    into: one step on zero gradients at learning rate 0 (moments stay zero, parameters unchanged;
    the load overwrites all of it). An optimizer that has state is left as it is."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)


def is_expert_param(name: str) -> bool:
    """An MoE expert's weight (split over expert-parallel ranks, replicated over expert-data-parallel ones)."""
    return ".mlp.experts." in name


def global_grad_norm(model: torch.nn.Module) -> float:
    """L2 norm of the whole model's gradient: TP shards counted once each, TP-duplicated weights
    once (on TP rank 0), the tied output-layer copy not at all; summed over TP and PP ranks.
    MoE experts (whole matrices on their EP rank) are summed over the expert-parallel and PP ranks."""
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    dense = torch.zeros(1, dtype=torch.float64)
    experts = torch.zeros(1, dtype=torch.float64)
    for name, p in model.named_parameters():
        if p.grad is None or getattr(p, "shared", False):
            continue
        if is_expert_param(name):
            experts += p.grad.detach().double().pow(2).sum().cpu()
            continue
        if not getattr(p, "tensor_model_parallel", False) and tp_rank != 0:
            continue
        dense += p.grad.detach().double().pow(2).sum().cpu()
    _sum_over(dense, ps.get_model_parallel_group())
    if any(is_expert_param(name) for name, _ in model.named_parameters()):
        _sum_over(experts, ps.get_expert_tensor_model_pipeline_parallel_group())
    return math.sqrt(dense.item() + experts.item())


def _sum_over(total: torch.Tensor, group) -> None:
    if dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)


RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


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

    def sharded_state_dict(self, model_sharded: dict, is_loading: bool) -> dict:
        """The distributed optimizer's state in megatron's ``fully_reshardable`` form: fp32 main
        weights and Adam moments gathered per parameter (over DP) and declared with the
        parameter's TP sharding, so a save reloads under another TP or DP size. ``is_loading``: a
        fresh optimizer first gets zero state (megatron-core's distributed optimizer reads every
        parameter's step count before it initializes any state itself)."""
        if is_loading:
            for chained in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                create_adam_state(chained.optimizer)
        return self.optimizer.sharded_state_dict(model_sharded, is_loading, metadata=dict(RESHARDABLE))

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.optimizer.load_state_dict(loaded)


def make_optimizer(model: torch.nn.Module, config: TrainConfig, tconfig):
    """The CPU or GPU optimizer for ``model`` (a GPTModel stage)."""
    if torch.cuda.is_available():
        return GpuOptimizer(model, config, tconfig)
    return CpuOptimizer(model, config)
