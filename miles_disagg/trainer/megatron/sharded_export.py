"""Each rank's share of the HF tensors, for sharded publication (no rank gathers the whole model).

Who yields what (every rank computes the same from the export plan, with no communication):

- dense parameters: the pipeline stage that holds them; within the stage, the (data-parallel
  replica, TP rank) slots split the parameters by size (``assign_by_size``); the owning replica's
  TP group all-gathers the slices (collective over the TP group: every TP rank then holds the
  whole parameter) and the owning TP rank converts and yields it;
- expert parameters: the expert-parallel rank that holds the expert (with expert-data-parallel
  rank 0, context-parallel rank 0) converts and yields its whole matrices (expert TP is 1);
- the tied ``lm_head.weight`` alias goes with the embedding.

Nothing crosses pipeline stages or EP ranks; only TP slices travel.
"""

from __future__ import annotations

from typing import Iterator

import torch

from miles_disagg.trainer.megatron.convert import ModelShape, ParamRule, to_hf
from miles_disagg.trainer.megatron.export import EMBEDDING, TIED_HEAD, ExportPlan
from miles_disagg.trainer.megatron.model import ParallelLayout
from miles_disagg.weights.shares import assign_by_size


def share_rules(plan: ExportPlan, layout: ParallelLayout) -> list[tuple[ParamRule, bool]]:
    """The rules this rank takes part in exporting, in order, each with whether it yields them."""
    rules = [r for r in plan.stage_rules[layout.pp_rank] if r.export]
    dense_sizes = {r.megatron: sum(_nbytes(plan, n) for n in r.hf) for r in rules if not r.is_expert}
    slots = assign_by_size(dense_sizes, layout.dp_size * layout.tp_size)  # slot: dp_rank * tp_size + tp_rank
    owner = {name: slot for slot, names in enumerate(slots) for name in names}
    out = []
    for rule in rules:
        if layout.cp_rank != 0:
            continue
        if rule.is_expert:
            if layout.expert_dp_rank == 0 and layout.ep_rank == rule.ep_owner:
                out.append((rule, True))
        elif owner[rule.megatron] // layout.tp_size == layout.dp_rank:
            out.append((rule, owner[rule.megatron] % layout.tp_size == layout.tp_rank))
    return out


def share_names(plan: ExportPlan, layout: ParallelLayout) -> frozenset[str]:
    """The HF names :func:`export_share` yields on this rank."""
    names = {n for rule, yields in share_rules(plan, layout) if yields for n in rule.hf}
    if plan.tied_head_alias and EMBEDDING in names:
        names.add(TIED_HEAD)
    return frozenset(names)


def export_share(model: torch.nn.Module, shape: ModelShape, layout: ParallelLayout,
                 plan: ExportPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield this rank's share as ``(hf_name, cpu_tensor)`` (collective within each TP group)."""
    params = dict(model.named_parameters())
    for rule, yields in share_rules(plan, layout):
        shards = [params[rule.megatron].detach()]
        if not rule.is_expert and rule.kind != "dup" and layout.tp_size > 1:
            shards = _gather_tp(shards[0])
        if not yields:
            continue
        tensors = [(name, t.to(device="cpu", dtype=plan.dtypes[name], copy=True).contiguous())
                   for name, t in to_hf(rule, shards, shape)]
        for name, tensor in tensors:
            yield name, tensor
            if plan.tied_head_alias and name == EMBEDDING:
                yield TIED_HEAD, tensor.clone()


def _gather_tp(local: torch.Tensor) -> list[torch.Tensor]:
    """Every TP rank's slice of a parameter, on every rank of the TP group (collective)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(shards, local.contiguous(), group=group)
    return shards


def _nbytes(plan: ExportPlan, name: str) -> int:
    count = 1
    for d in plan.shapes[name]:
        count *= d
    return count * plan.dtypes[name].itemsize
