"""miles' tensor layout for user loss code, and back.

The trainer keeps a micro-batch right-padded: ``[batch, response]`` per-token tensors
(``PackedBatch``). miles hands its loss functions, TIS functions and reducers the "thd" layout:
one list entry per sample (``loss_masks[i]``, ``log_probs[i]``: that sample's response tokens
only) and flat per-token tensors that concatenate the samples' response tokens
(``pg_loss``: ``sum(response_lengths)`` values); the logits are ``[1, T, vocab]`` with ``T`` the
samples' prompt-plus-response lengths laid end to end. This module converts between the two,
exactly (no value changes, gradients flow through every conversion).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def response_lengths(batch) -> list[int]:
    """Each sample's number of response tokens (``PackedBatch.response_mask``)."""
    return [int(n) for n in batch.response_mask.sum(dim=-1).tolist()]


def total_lengths(batch) -> list[int]:
    """Each sample's prompt plus response length."""
    return [int(start) + n for start, n in zip(batch.response_start.tolist(), response_lengths(batch))]


def per_sample(values: torch.Tensor, lengths: Sequence[int]) -> list[torch.Tensor]:
    """``[batch, width]`` -> each row's first ``lengths[i]`` values (views: gradients flow)."""
    return [values[i, :n] for i, n in enumerate(lengths)]


def flatten(values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """``[batch, width]`` -> miles' flat per-token tensor (the rows' first ``lengths[i]`` values)."""
    return torch.cat(per_sample(values, lengths), dim=0)


def unflatten(flat: torch.Tensor, lengths: Sequence[int], width: int) -> torch.Tensor:
    """miles' flat per-token tensor -> ``[batch, width]``, 0 after each row's ``lengths[i]`` values."""
    if flat.shape[0] != sum(lengths):
        raise ValueError(f"a flat per-token tensor of {flat.shape[0]} values for responses of {sum(lengths)} tokens")
    rows = torch.split(flat, list(lengths), dim=0)
    return torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[0])) for row in rows])


def padded(rows: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """One 1-D tensor per sample -> ``[batch, width]``, 0 after each row's values."""
    return torch.stack([torch.nn.functional.pad(row, (0, width - row.shape[0])) for row in rows])


def sample_mean_reducer(lengths: Sequence[int], loss_masks: Sequence[torch.Tensor], per_token: bool,
                        denominators: Sequence[torch.Tensor] | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """miles' ``sum_of_sample_mean`` (no context parallelism) over a flat per-token tensor.

    Per sample (default): the sum over samples of each sample's ``(x * mask).sum() / max(n, 1)``,
    ``n`` the sample's ``denominators`` entry summed (default: its mask). ``per_token``: the
    sum of ``x * mask`` over every token. Either way the backend divides by the step's global
    sample or token count, as for the built-in loss (``losses.masked_sum``).
    """
    counts = [(d if denominators is not None else m).sum().clamp(min=1) for m, d in
              zip(loss_masks, denominators if denominators is not None else loss_masks)]

    def reduce(values: torch.Tensor) -> torch.Tensor:
        parts = torch.split(values, list(lengths), dim=0)
        if per_token:
            return sum((part * mask).sum() for part, mask in zip(parts, loss_masks))
        return sum((part * mask).sum() / count for part, mask, count in zip(parts, loss_masks, counts))

    return reduce


def thd_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """``[batch, seq, vocab]`` right-padded logits -> miles' ``[1, T, vocab]`` in float32 (float64
    stays float64; each sample's prompt-plus-response positions laid end to end); gradients flow
    back to ``logits``."""
    lengths = total_lengths(batch)
    thd = torch.cat([logits[i, :n] for i, n in enumerate(lengths)], dim=0)
    return (thd if thd.dtype == torch.float64 else thd.float()).unsqueeze(0)


def unconcat_tokens(batch) -> list[torch.Tensor]:
    """Each sample's prompt-plus-response token ids (miles' ``batch["unconcat_tokens"]``)."""
    return [batch.input_ids[i, :n] for i, n in enumerate(total_lengths(batch))]


class ParallelGroup:
    """One parallel dimension as a miles loss function sees it: ``size``, ``rank``, ``group``."""

    def __init__(self, size: int = 1, rank: int = 0, group=None):
        self.size, self.rank, self.group = size, rank, group


class ParallelState:
    """miles' ``parallel_state`` argument. A user loss here always sees whole sequences on one rank
    (context parallelism is refused with a custom loss, tensor-parallel logits are gathered), so
    every dimension is trivial: size 1, rank 0, no group. The data-parallel reduction is the
    backend's (the returned loss is in sum form)."""

    def __init__(self) -> None:
        for name in ("dp", "cp", "tp", "pp", "ep", "etp", "dp_cp"):
            setattr(self, name, ParallelGroup())
