"""Global normalisation over data-parallel ranks: step denominators and step metrics.

Every function here is collective over ``group`` (``None``: the default group; one rank or no
process group: a no-op). Every rank of the group must call them in the same order with the
same metric names. ``device`` is where the reduced tensors live (CUDA under nccl).
"""

from __future__ import annotations

from typing import Sequence

import torch


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` summed over the ranks of ``group``, in place (returned for convenience)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def sum_over_ranks(values: Sequence[float], group=None, device: torch.device | str = "cpu") -> list[float]:
    """Each of ``values`` summed over the ranks of ``group`` (float64)."""
    if not values:
        return []
    return all_reduce_sum(torch.tensor(list(values), dtype=torch.float64, device=device), group).tolist()


def group_size(group=None) -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def step_denominators(steps: Sequence[Sequence], *, per_token: bool, group=None,
                      device: torch.device | str = "cpu") -> list[float]:
    """For each optimizer step (a list of this rank's ``PackedBatch`` micro-batches), the GLOBAL
    number of samples (per-sample loss) or trained tokens (``per_token``) over ``group``; at least 1."""
    local = [float(sum(b.num_tokens if per_token else b.num_samples for b in step)) for step in steps]
    return [max(value, 1.0) for value in sum_over_ranks(local, group, device)]


class StepMetrics:
    """One optimizer step's metrics in sum form (``losses.masked_sum``), accumulated over its micro-batches."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}

    def add(self, sums: dict[str, float]) -> None:
        for key, value in sums.items():
            self._sums[key] = self._sums.get(key, 0.0) + float(value)

    def global_means(self, denominator: float, group=None, device: torch.device | str = "cpu") -> dict[str, float]:
        """Every metric summed over ``group`` and divided by the step's global ``denominator``."""
        keys = sorted(self._sums)
        totals = sum_over_ranks([self._sums[k] for k in keys], group, device)
        return {key: value / denominator for key, value in zip(keys, totals)}


def global_sample_mean(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group=None,
                       device: torch.device | str = "cpu") -> float:
    """The mean over samples (rows, all pairs and all ranks of ``group``) of each sample's mean of
    ``values`` over its tokens where ``mask`` is 1 (its token count clamped at 1, as miles'
    ``sum_of_sample_mean``; 0 when there is no sample)."""
    total, count = 0.0, 0.0
    for values, mask in pairs:
        mask = mask.to(values.device)
        total += ((values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum().item()
        count += float(values.shape[0])
    total, count = sum_over_ranks([total, count], group, device)
    return total / count if count else 0.0


def global_token_mean(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], group=None,
                      device: torch.device | str = "cpu") -> float:
    """The mean of ``values`` over every token where ``mask`` is 1, over all ``(values, mask)``
    pairs and all ranks of ``group`` (0 when there is none)."""
    total, count = 0.0, 0.0
    for values, mask in pairs:
        mask = mask.to(values.device)
        total += (values * mask).sum().item()
        count += mask.sum().item()
    total, count = sum_over_ranks([total, count], group, device)
    return total / count if count else 0.0
