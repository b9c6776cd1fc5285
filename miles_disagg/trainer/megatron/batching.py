"""Micro-batches for the megatron backend (with the engine's routed experts of MoE samples:
:func:`routing_targets`, which routing replay in ``moe.py`` consumes), and the context-parallel
(CP) sequence layout. Pure torch.

Context parallelism splits each padded sequence into ``2 * cp`` equal chunks and gives CP
rank ``r`` chunks ``r`` and ``2 * cp - 1 - r`` (so every rank gets the same share of
causal-attention work); ``cp_split`` takes a rank's part, ``cp_merge`` puts gathered parts
back in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from miles_disagg.trainer.batches import PackedBatch, pack
from miles_disagg.samples import Sample


def token_budget_batches(samples: Sequence[Sample], max_tokens: int) -> list[list[Sample]]:
    """Consecutive micro-batches whose padded size (samples x longest sample) stays within
    ``max_tokens``; a sample longer than the budget alone gets its own micro-batch."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[Sample]] = []
    current: list[Sample] = []
    longest = 0
    for sample in samples:
        length = len(sample.prompt_ids) + len(sample.response_ids)
        if current and (len(current) + 1) * max(longest, length) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(sample)
        longest = max(longest, length)
    if current:
        batches.append(current)
    return batches


def fixed_size_batches(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    return [list(samples[i:i + size]) for i in range(0, len(samples), size)]


@dataclass
class MicroBatch:
    """One micro-batch: the packed samples, the next token at every position, and the
    positions whose logits predict each response token (``[batch, response]``)."""

    packed: PackedBatch
    targets: torch.Tensor
    response_positions: torch.Tensor
    routing: tuple[torch.Tensor, torch.Tensor] | None = None  # MoE: engine experts, trained positions

    @property
    def seq_len(self) -> int:
        return self.packed.input_ids.shape[1]


def make_micro_batch(samples: Sequence[Sample], pad_id: int, seq_multiple: int,
                     moe: tuple[int, int, int] | None = None) -> MicroBatch:
    """Pack ``samples``, right-padding the sequence to a multiple of ``seq_multiple`` (sequence
    and context parallelism split it); padding sits after every real token, so under causal
    attention it changes no real token's logits. ``moe`` ``(layers, top_k, experts)``: also the
    samples' routed experts (:func:`routing_targets`)."""
    packed = pack(samples, pad_id)
    length = packed.input_ids.shape[1]
    padded = -(-length // seq_multiple) * seq_multiple
    if padded != length:
        extra = padded - length
        packed.input_ids = torch.nn.functional.pad(packed.input_ids, (0, extra), value=pad_id)
        packed.attention_mask = torch.nn.functional.pad(packed.attention_mask, (0, extra), value=0)
    targets = torch.roll(packed.input_ids, shifts=-1, dims=1)
    targets[:, -1] = pad_id
    num_resp = packed.response_ids.shape[1]
    positions = packed.response_start.unsqueeze(1) - 1 + torch.arange(num_resp).unsqueeze(0)
    routing = routing_targets(samples, padded, *moe) if moe is not None else None
    return MicroBatch(packed, targets, positions.clamp(min=0, max=padded - 1), routing)


def routing_targets(samples: Sequence[Sample], seq_len: int, num_layers: int, topk: int,
                    num_experts: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``([batch, seq, layers, topk]`` engine experts, -1 where there are none; ``[batch, seq]``
    trained positions) of a micro-batch, or None when no sample carries routed experts.
    ``ValueError`` naming the sample when its array has the wrong shape or (given
    ``num_experts``) a row that is neither all -1 nor ``topk`` distinct experts in range."""
    if not any(s.rollout_routed_experts is not None for s in samples):
        return None
    import numpy as np

    experts = torch.full((len(samples), seq_len, num_layers, topk), -1, dtype=torch.long)
    counted = torch.zeros((len(samples), seq_len), dtype=torch.bool)
    for i, sample in enumerate(samples):
        routed = sample.rollout_routed_experts
        if routed is None:
            continue
        routed = np.asarray(routed)
        positions = len(sample.prompt_ids) + len(sample.response_ids) - 1
        if routed.shape != (positions, num_layers, topk):
            raise ValueError(f"sample {i} of the micro-batch: rollout_routed_experts has shape {tuple(routed.shape)}, expected "
                             f"({positions}, {num_layers}, {topk}) (positions, layers, top-k)")
        rows = torch.from_numpy(routed.astype(np.int64))
        if num_experts is not None:
            _check_rows(rows, num_experts, i)
        experts[i, :positions] = rows
        start = len(sample.prompt_ids) - 1
        mask = torch.tensor(sample.trained_mask(), dtype=torch.bool)
        counted[i, start:start + len(mask)] = mask
    return experts, counted


def _check_rows(rows: torch.Tensor, num_experts: int, index: int) -> None:
    free = (rows == -1).all(dim=-1)
    valid = ((rows >= 0) & (rows < num_experts)).all(dim=-1)
    distinct = (rows.sort(dim=-1).values.diff(dim=-1) != 0).all(dim=-1)
    bad = ~(free | (valid & distinct))
    if bad.any():
        position, layer = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"sample {index} of the micro-batch: rollout_routed_experts[{position}, {layer}] = "
                         f"{rows[position, layer].tolist()} is neither all -1 nor distinct experts in "
                         f"[0, {num_experts})")


def cp_split(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """CP rank ``cp_rank``'s part of ``tensor`` along ``dim`` (length divisible by ``2 * cp_size``)."""
    if cp_size == 1:
        return tensor
    chunks = tensor.chunk(2 * cp_size, dim=dim)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]], dim=dim)


def cp_merge(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of ``cp_split``: ``parts[r]`` is CP rank r's part; returns the whole tensor."""
    cp_size = len(parts)
    if cp_size == 1:
        return parts[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, part in enumerate(parts):
        first, second = part.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)  # type: ignore[arg-type]


def causal_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """megatron's mask convention: ``True`` marks a position a query may not attend to."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]
