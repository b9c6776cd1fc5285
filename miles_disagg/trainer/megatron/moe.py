"""Megatron MoE: the ``TransformerConfig`` fields of a Qwen3-MoE checkpoint, and routing replay.

Router math (HF Qwen3-MoE): softmax over the experts in float32, top-k, and with
``norm_topk_prob`` the k weights renormalized. megatron-core's softmax router computes the
same thing with ``moe_router_pre_softmax`` off (top-k of the logits, softmax over those k) and
without ``norm_topk_prob`` with it on (softmax over all, then top-k); no top-k scaling.

Routing replay: every ``TopKRouter`` of a model gets a :class:`RouterTap` in place of its
``router_replay`` (megatron-core 0.16's hook: the router calls ``get_replay_topk`` for its top-k).
The tap picks each token's experts:

- replay (``--use-rollout-routing-replay``): the engine's experts where the micro-batch has
  them (positions ``p < len - 1`` of a sample carrying ``rollout_routed_experts``), the
  router's own top-k elsewhere (the last position, padding);
- the recorded forward routing while recomputed layers run again in backward
  (``--use-routing-replay``: recomputation routes as the forward did).

The k weights are always the router's own scores gathered at the chosen experts (softmax
afterwards as above), so the router still gets gradients. The taps also count, over
trained tokens (response positions with loss mask 1) and sparse layers, how often the
router's own top-k set equals the engine's (``train/routing_agreement``) and how often the
experts actually used do (``train/routing_replay_match``).
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch

from miles_disagg.config.training import TrainConfig
from miles_disagg.trainer.megatron.batching import cp_split

_ROUTER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.mlp\.router$")


def moe_config_fields(shape, config: TrainConfig, layout) -> dict:
    """megatron ``TransformerConfig`` fields for ``shape`` (a Qwen3-MoE) under miles' MoE flags."""
    return dict(
        num_moe_experts=shape.num_experts, moe_router_topk=shape.moe_topk,
        moe_ffn_hidden_size=shape.moe_ffn_hidden_size, moe_layer_freq=[int(s) for s in shape.sparse_layers],
        moe_router_score_function="softmax", moe_router_pre_softmax=not shape.norm_topk_prob,
        moe_router_topk_scaling_factor=None,
        moe_router_dtype=config.moe_router_dtype,
        moe_token_dispatcher_type=config.moe_token_dispatcher_type or default_dispatcher(layout.ep_size),
        moe_router_load_balancing_type=config.moe_router_load_balancing_type or "aux_loss",
        moe_aux_loss_coeff=config.moe_aux_loss_coeff or 0.0,
        moe_token_drop_policy=config.moe_token_drop_policy or "probs",
        moe_grouped_gemm=bool(config.moe_grouped_gemm), moe_permute_fusion=bool(config.moe_permute_fusion),
        expert_model_parallel_size=layout.ep_size, expert_tensor_parallel_size=1)


def set_aux_loss_scale(num_microbatches: int) -> None:
    """The load-balancing loss's gradient weight per micro-batch, as megatron's schedules set it
    (1 / micro-batches: the aux loss is averaged over the step's micro-batches)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / num_microbatches))


def default_dispatcher(ep_size: int) -> str:
    """Unset ``--moe-token-dispatcher-type``: megatron's allgather without expert parallelism;
    alltoall with it (allgather needs equal token counts on every EP rank, which RL
    micro-batches of different lengths do not have)."""
    return "alltoall" if ep_size > 1 else "allgather"


@dataclass
class RoutingCounts:
    """Sums over (trained token, sparse layer) rows: rows with engine routing, rows where the
    router's own top-k set equals the engine's, rows where the experts used do."""

    rows: float = 0.0
    agreed: float = 0.0
    matched: float = 0.0

    def add(self, other: "RoutingCounts") -> None:
        self.rows += other.rows
        self.agreed += other.agreed
        self.matched += other.matched


@dataclass
class RouterTap:
    """Stands in for one router's ``router_replay`` (see the module docstring)."""

    layer: int  # the global (HF) layer index
    target: torch.Tensor | None = None  # [tokens, k] engine experts, -1 rows: route freely
    counted: torch.Tensor | None = None  # [tokens] rows that count in the metrics
    use_target: bool = False  # replay the target (else only compare with it)
    record: bool = False
    recorded: list[torch.Tensor] = field(default_factory=list)
    replay_recorded: bool = False
    counts: RoutingCounts = field(default_factory=RoutingCounts)

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.replay_recorded and self.recorded:
            used = self.recorded.pop(0).to(scores.device)
        elif self.use_target and self.target is not None:
            target = self.target.to(scores.device)
            used = torch.where((target[:, :1] >= 0), target, own)
        else:
            used = own
        if self.replay_recorded:
            return scores.gather(1, used), used
        if self.record:
            self.recorded.append(used.detach())
        if self.target is not None and self.counted is not None:
            self._count(own, used)
        return scores.gather(1, used), used

    def _count(self, own: torch.Tensor, used: torch.Tensor) -> None:
        target = self.target.to(own.device)
        rows = self.counted.to(own.device) & (target[:, 0] >= 0)
        engine = target.sort(dim=1).values
        self.counts.rows += float(rows.sum())
        self.counts.agreed += float((rows & (own.sort(dim=1).values == engine).all(dim=1)).sum())
        self.counts.matched += float((rows & (used.sort(dim=1).values == engine).all(dim=1)).sum())


class RoutingControl:
    """The taps of one model (one pipeline stage), installed on its routers at construction.

    ``begin`` before each micro-batch's forward sets its engine routing; the backward then
    runs under ``backward()``, where recomputed routers take what the forward used (kept
    only when layers are recomputed and a replay flag is on; FIFO per router, so pipelined
    schedules that recompute micro-batches in forward order work too)."""

    def __init__(self, model: torch.nn.Module, stage_layers: range, *, replay_rollout: bool,
                 replay_recompute: bool, recomputes: bool, sequence_parallel: bool, tp_rank: int, tp_size: int,
                 cp_rank: int = 0, cp_size: int = 1):
        self.replay_rollout = replay_rollout
        self.keep_for_recompute = recomputes and (replay_recompute or replay_rollout)
        self.sequence_parallel, self.tp_rank, self.tp_size = sequence_parallel, tp_rank, tp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.taps: list[RouterTap] = []
        for name, module in model.named_modules():
            match = _ROUTER_NAME.search(name)
            if match and hasattr(module, "router_replay"):
                tap = RouterTap(layer=stage_layers[int(match.group(1))])
                module.router_replay = tap
                self.taps.append(tap)

    def begin(self, targets: tuple[torch.Tensor, torch.Tensor] | None, *, training: bool, count: bool) -> None:
        """Route the next micro-batch: replay ``targets`` (engine experts, trained positions)
        with ``--use-rollout-routing-replay``, else only compare with them (counted when ``count``)."""
        for tap in self.taps:
            tap.record = training and self.keep_for_recompute
            tap.replay_recorded, tap.use_target = False, self.replay_rollout
            tap.target = tap.counted = None
            if targets is not None:
                tap.target, counted = self._router_rows(targets, tap.layer)
                tap.counted = counted if count else None

    def end(self) -> None:
        """Forget every micro-batch's routing (the end of a pass)."""
        for tap in self.taps:
            tap.target = tap.counted = None
            tap.recorded.clear()
            tap.record = tap.replay_recorded = False

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """While a backward runs: recomputed routers replay the forward's routing (when kept)."""
        for tap in self.taps:
            tap.replay_recorded = self.keep_for_recompute
        try:
            yield
        finally:
            for tap in self.taps:
                tap.replay_recorded = False

    def _router_rows(self, targets: tuple[torch.Tensor, torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's token order: megatron flattens ``[seq, batch]`` (this rank's part of the
        sequence under context / sequence parallelism)."""
        experts, counted = targets[0][:, :, layer], targets[1]
        experts, counted = cp_split(experts, self.cp_size, self.cp_rank), cp_split(counted, self.cp_size, self.cp_rank)
        experts, counted = experts.transpose(0, 1), counted.transpose(0, 1)  # [seq, batch, ...]
        if self.sequence_parallel and self.tp_size > 1:
            experts = experts.chunk(self.tp_size, dim=0)[self.tp_rank]
            counted = counted.chunk(self.tp_size, dim=0)[self.tp_rank]
        return experts.reshape(-1, experts.shape[-1]), counted.reshape(-1)

    def take_counts(self) -> RoutingCounts:
        total = RoutingCounts()
        for tap in self.taps:
            total.add(tap.counts)
            tap.counts = RoutingCounts()
        return total
