"""Routing replay for the FSDP backend on a Qwen3-MoE, and the routing metrics.

``--use-rollout-routing-replay``: the forward over ``prompt_ids + response_ids`` routes position
``p < len - 1`` to ``Sample.rollout_routed_experts[p]`` (the engine's experts), the last position
freely. ``--use-routing-replay``: the first forward pass of a rollout (the one that computes the
old logprobs) records its own routing and the training passes (forward and backward) replay it.

Metrics, over the positions whose logits predict a trained token and the layers with experts:

* ``train/routing_replay_match``: fraction of replayed top-k sets the trainer used that equal the
  engine's (1.0 whenever replay works);
* ``train/routing_agreement``: fraction where the trainer router's own top-k set equals the engine's
  (whether or not it is replayed).

Both need samples carrying the engine's routing; without it they are not logged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from miles_disagg.trainer.batches import PackedBatch
from miles_disagg.samples import Sample
from miles_disagg.types import InvalidInput

REPLAY_MATCH, AGREEMENT = "train/routing_replay_match", "train/routing_agreement"
MOE_TYPE = "qwen3_moe"


@dataclass(frozen=True)
class RoutingShape:
    layers: int
    top_k: int
    sparse_layers: tuple[int, ...]
    num_experts: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> "RoutingShape | None":
        """A Qwen3-MoE's shape, native or transformers' (None for any other model: nothing to route)."""
        config = getattr(model, "config", None)
        if getattr(config, "model_type", MOE_TYPE) != MOE_TYPE or not getattr(config, "num_experts", 0):
            return None
        skip, step = set(getattr(config, "mlp_only_layers", None) or ()), config.decoder_sparse_step
        sparse = tuple(i for i in range(config.num_hidden_layers) if i not in skip and (i + 1) % step == 0)
        if not sparse:
            return None
        return cls(config.num_hidden_layers, config.num_experts_per_tok, sparse, config.num_experts)


def pack_engine_routing(samples: Sequence[Sample], seq_len: int, shape: RoutingShape) -> torch.Tensor | None:
    """``[batch, seq_len, layers, top_k]`` long: each sample's ``rollout_routed_experts`` at its
    positions, -1 elsewhere (its last position and the padding route freely). None when no sample
    carries routing; ``InvalidInput`` naming the sample when one has the wrong shape."""
    if all(s.rollout_routed_experts is None for s in samples):
        return None
    packed = torch.full((len(samples), seq_len, shape.layers, shape.top_k), -1, dtype=torch.long)
    for i, sample in enumerate(samples):
        if sample.rollout_routed_experts is None:
            continue
        routed = torch.as_tensor(sample.rollout_routed_experts)
        expected = (len(sample.prompt_ids) + len(sample.response_ids) - 1, shape.layers, shape.top_k)
        if tuple(routed.shape) != expected:
            raise InvalidInput(f"sample {i} of the micro-batch: rollout_routed_experts has shape "
                               f"{tuple(routed.shape)}, the model and its tokens need {expected}")
        routed = routed.long()
        if routed.numel() and (routed.min() < -1 or routed.max() >= shape.num_experts):
            raise InvalidInput(f"sample {i} of the micro-batch: rollout_routed_experts holds expert ids outside "
                               f"[-1, {shape.num_experts}): {routed.min().item()}..{routed.max().item()}")
        packed[i, :expected[0]] = routed
    return packed


def require_engine_routing(samples: Sequence[Sample]) -> None:
    """``--use-rollout-routing-replay`` trains only samples that carry the engine's routing."""
    missing = sum(s.rollout_routed_experts is None for s in samples)
    if missing:
        raise InvalidInput(f"--use-rollout-routing-replay: {missing} of {len(samples)} samples carry no "
                           "rollout_routed_experts; the rollout must request routed experts from the engines")


def trained_positions(batch: PackedBatch) -> torch.Tensor:
    """Bool ``[batch, seq]``: the positions whose logits predict a trained response token."""
    n, seq_len = batch.input_ids.shape
    positions = torch.zeros((n, seq_len), dtype=torch.bool)
    resp_len = batch.response_ids.shape[1]
    offsets = (torch.arange(resp_len)[None, :] + batch.response_start[:, None] - 1).clamp(0, seq_len - 1)
    positions.scatter_(1, offsets, batch.loss_mask.bool())
    return positions


def equal_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise over ``[..., top_k]``: whether the two top-k index sets are equal."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


@dataclass
class RoutingCounts:
    """Sums for one optimizer step: ``(matching, compared)`` per metric."""

    replay_match: float = 0.0
    replayed: float = 0.0
    agreement: float = 0.0
    compared: float = 0.0

    def add(self, batch: PackedBatch, shape: RoutingShape, engine: torch.Tensor | None, used: torch.Tensor,
            own: torch.Tensor, replaying_engine: bool) -> None:
        """``used``/``own``: the experts the forward used and the router's own top-k, ``[b, s, L, k]``."""
        if engine is None:
            return
        layers = list(shape.sparse_layers)
        where = trained_positions(batch).to(used.device)
        where = where & (engine[:, :, layers[0]] >= 0).all(-1).to(used.device)  # positions the engine routed
        engine = engine.to(used.device)[:, :, layers][where]
        own_sets = equal_sets(own[:, :, layers][where].long(), engine)
        self.agreement += float(own_sets.sum())
        self.compared += float(own_sets.numel())
        if replaying_engine:
            used_sets = equal_sets(used[:, :, layers][where].long(), engine)
            self.replay_match += float(used_sets.sum())
            self.replayed += float(used_sets.numel())

    def global_metrics(self, device: torch.device) -> dict[str, float]:
        from miles_disagg.trainer.reduction import sum_over_ranks

        match, replayed, agree, compared = sum_over_ranks(
            [self.replay_match, self.replayed, self.agreement, self.compared], device=device)
        metrics = {}
        if compared:
            metrics[AGREEMENT] = agree / compared
        if replayed:
            metrics[REPLAY_MATCH] = match / replayed
        return metrics


@dataclass
class RoutedOutput:
    """A transformers model's output with the routing its routers recorded (the native model's fields)."""

    logits: torch.Tensor
    routed_experts: torch.Tensor
    router_choice: torch.Tensor


class RouterReplay:
    """Routing replay on transformers' ``Qwen3MoeForCausalLM`` (the fsdp backend's model on CUDA).

    A forward hook on each sparse layer's router (``mlp.gate``, returning ``(logits, weights,
    indices)``) replaces the indices by the replayed ones (rows holding -1 keep the router's) and
    the weights by the router's softmax probabilities gathered there (renormalised if
    ``norm_topk_prob``), the native model's rule; it records the experts used and the router's own."""

    def __init__(self, model: torch.nn.Module, shape: RoutingShape):
        self.shape, self.norm_topk_prob = shape, bool(getattr(model.config, "norm_topk_prob", False))
        self._forced: torch.Tensor | None = None
        self._used: torch.Tensor | None = None
        self._own: torch.Tensor | None = None
        for layer in shape.sparse_layers:
            model.model.layers[layer].mlp.gate.register_forward_hook(self._hook(layer))

    def forward(self, model: torch.nn.Module, routing: torch.Tensor | None, **inputs) -> RoutedOutput:
        rows, length = inputs["input_ids"].shape
        size = (rows, length, self.shape.layers, self.shape.top_k)
        self._used = torch.full(size, -1, dtype=torch.int32, device=inputs["input_ids"].device)
        self._own, self._forced = self._used.clone(), routing
        try:
            logits = model(**inputs).logits
        finally:
            self._forced = None
        return RoutedOutput(logits, self._used, self._own)

    def _hook(self, layer: int):
        def hook(_module, _inputs, output):
            if self._used is None:
                return None
            logits, weights, indices = output
            rows, length = self._used.shape[:2]
            own, used = indices, indices
            if self._forced is not None:
                forced = self._forced[:, :, layer].reshape(-1, indices.shape[-1]).to(indices.device)
                replay = (forced >= 0).all(dim=-1)
                used = torch.where(replay[:, None], forced.clamp(min=0).to(indices.dtype), indices)
                probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, used)
                if self.norm_topk_prob:
                    probs = probs / probs.sum(dim=-1, keepdim=True)
                weights = probs.to(weights.dtype)
            self._used[:, :, layer] = used.reshape(rows, length, -1).to(torch.int32)
            self._own[:, :, layer] = own.reshape(rows, length, -1).to(torch.int32)
            return logits, weights, used
        return hook
