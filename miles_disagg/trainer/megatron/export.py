"""Gather the megatron policy into canonical HF tensors on the source rank (global rank 0).

Collective over the ranks of data-parallel replica 0 and context-parallel rank 0 (the
others hold copies and return at once). Pipeline stages are walked in order; within a
stage every parameter's TP shards are all-gathered over the TP group, TP rank 0 converts
them to HF layout and checkpoint dtype, and a stage other than the first sends them to the
source rank, which yields them. Only the source rank yields anything. Copies that are not
HF tensors of their own (the tied output layer) are skipped; a tied checkpoint that still
stores ``lm_head.weight`` gets the embedding under that name too.

MoE with expert parallelism: experts live on their EP rank (``ParamRule.ep_owner``), and the
ranks with expert-data-parallel rank 0 take part in the export of expert tensors: the owner
sends each of its experts' whole matrices (expert TP is 1) to the stage's exporting rank
(EP rank 0 of its EP group), which converts them like any other tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from miles_disagg.trainer.megatron.convert import ModelShape, ParamRule, param_rules, stage_layers, to_hf
from miles_disagg.trainer.megatron.model import ParallelLayout
from miles_disagg.types import ConfigError

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


@dataclass(frozen=True)
class ExportPlan:
    """The checkpoint's tensor names, dtypes and shapes, and each stage's conversion rules."""

    dtypes: dict[str, torch.dtype]
    shapes: dict[str, tuple[int, ...]]
    stage_rules: list[list[ParamRule]]
    tied_head_alias: bool

    @classmethod
    def build(cls, hf_dir: str, shape: ModelShape, pp_size: int, fused_norms: bool, ep_size: int = 1,
              grouped_experts: bool = False) -> "ExportPlan":
        """``ConfigError`` unless the rules export exactly the tensors the checkpoint holds."""
        from miles_disagg.weights.safetensors_io import checkpoint_tensors
        from miles_disagg.weights.torch_bytes import dtype_from_code

        entries = {name: entry for name, (_, entry) in checkpoint_tensors(hf_dir).items()}
        stages = [param_rules(shape, stage_layers(shape.num_layers, pp_size, s), pre_process=s == 0,
                              post_process=s == pp_size - 1, fused_norms=fused_norms, ep_size=ep_size,
                              grouped_experts=grouped_experts) for s in range(pp_size)]
        exported = {name for rules in stages for rule in rules if rule.export for name in rule.hf}
        alias = shape.tied_embeddings and TIED_HEAD in entries
        if alias:
            exported.add(TIED_HEAD)
        if exported != set(entries):
            raise ConfigError(f"{hf_dir}: the megatron conversion covers different tensors than the checkpoint "
                              f"(only in the checkpoint: {sorted(set(entries) - exported)[:5]}, "
                              f"only in the conversion: {sorted(exported - set(entries))[:5]})", ("--hf-checkpoint",))
        return cls(dtypes={n: dtype_from_code(e.dtype) for n, e in entries.items()},
                   shapes={n: tuple(e.shape) for n, e in entries.items()}, stage_rules=stages, tied_head_alias=alias)


def export_hf(model: torch.nn.Module, shape: ModelShape, layout: ParallelLayout,
              plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, cpu_tensor)`` on global rank 0; see the module docstring (collective)."""
    dense_part = layout.dp_rank == 0 and layout.cp_rank == 0
    expert_part = layout.expert_dp_rank == 0 and layout.cp_rank == 0
    if not dense_part and not expert_part:
        return
    params = dict(model.named_parameters())
    for stage, rules in enumerate(plan.stage_rules):
        if stage != layout.pp_rank and not (layout.pp_rank == 0 and layout.tp_rank == 0 and dense_part):
            continue
        for rule in rules:
            if not rule.export or not (expert_part if rule.is_expert else dense_part):
                continue
            if stage == layout.pp_rank:
                tensors = (_gather_expert(params, rule, shape, layout, plan) if rule.is_expert
                           else _convert_local(params[rule.megatron], rule, shape, layout, plan))
                if stage != 0:
                    _send_to_source(tensors, layout)
                    continue
            else:
                tensors = _receive_from_stage(rule, stage, plan)
            for name, tensor in tensors:
                yield name, tensor
                if plan.tied_head_alias and name == EMBEDDING:
                    yield TIED_HEAD, tensor.clone()


def _gather_expert(params: dict, rule: ParamRule, shape: ModelShape, layout: ParallelLayout,
                   plan: ExportPlan) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of an expert's parameter on the stage's exporting rank (EP rank 0 of its
    EP group), sent there by the owning EP rank; ``[]`` on the other ranks. Every EP rank holds
    a parameter of the same name and shape (its own expert of that local number)."""
    from megatron.core import parallel_state as ps

    exporter = layout.ep_rank == 0
    if exporter and rule.ep_owner == 0:
        local = params[rule.megatron].detach()
    elif exporter:
        ep_ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
        buffer = _on_comm_device(torch.empty_like(params[rule.megatron].detach()))
        dist.recv(buffer, src=ep_ranks[rule.ep_owner])
        local = buffer
    else:
        if layout.ep_rank == rule.ep_owner:
            ep_ranks = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
            dist.send(_on_comm_device(params[rule.megatron].detach().contiguous()), dst=ep_ranks[0])
        return []
    return [(name, t.to(device="cpu", dtype=plan.dtypes[name], copy=True).contiguous())
            for name, t in to_hf(rule, [local], shape)]


def _convert_local(param: torch.Tensor, rule: ParamRule, shape: ModelShape, layout: ParallelLayout,
                   plan: ExportPlan) -> list[tuple[str, torch.Tensor]]:
    """TP rank 0 of this stage gets the HF tensors; the other TP ranks only join the gather."""
    from megatron.core import parallel_state as ps

    local = param.detach()
    if rule.kind == "dup" or layout.tp_size == 1:
        shards = [local]
    else:
        shards = [torch.empty_like(local) for _ in range(layout.tp_size)]
        dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
    if layout.tp_rank != 0:
        return []
    return [(name, t.to(device="cpu", dtype=plan.dtypes[name], copy=True).contiguous())
            for name, t in to_hf(rule, shards, shape)]


def _send_to_source(tensors: list[tuple[str, torch.Tensor]], layout: ParallelLayout) -> None:
    from megatron.core import parallel_state as ps

    source = ps.get_pipeline_model_parallel_first_rank()
    for _, tensor in tensors:  # only TP rank 0 has any
        dist.send(_on_comm_device(tensor), dst=source)


def _receive_from_stage(rule: ParamRule, stage: int, plan: ExportPlan) -> list[tuple[str, torch.Tensor]]:
    from megatron.core import parallel_state as ps

    sender = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())[stage]
    received = []
    for name in rule.hf:
        buffer = _on_comm_device(torch.empty(plan.shapes[name], dtype=plan.dtypes[name]))
        dist.recv(buffer, src=sender)
        received.append((name, buffer.cpu()))
    return received


def _on_comm_device(tensor: torch.Tensor) -> torch.Tensor:
    """nccl moves CUDA tensors only; gloo moves CPU tensors."""
    if dist.get_backend() == "nccl":
        return tensor.cuda()
    return tensor
