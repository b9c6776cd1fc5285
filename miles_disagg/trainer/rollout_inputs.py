"""What one rollout's optimizer steps take as fixed, computed once before the first step (both backends).

From the trainer's recomputed logprobs (the forward-only pass; None per micro-batch with
``--skip-actor-forward-only``) and the reference's, :func:`prepare_rollout` decides the behaviour
logprobs the ratio divides by (the engines' with ``--use-rollout-logprobs``, as in miles), the
per-token advantages (less the ``--use-opd`` term; none with ``--disable-compute-advantages-and-returns``)
and miles' returns (before that term and the whitening: what a custom loss reads),
each step's global denominator, and the rollout's mismatch metric ``train/train_rollout_logprob_abs_diff``: the
behaviour logprobs against the engines', a per-sample mean (a token mean with
``--calculate-per-token-loss``, over the loss's token count), so exactly 0 with ``--use-rollout-logprobs``.

Collective over ``group`` (whitening, denominators, the metric): every data-parallel rank calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from miles_disagg.trainer.advantages import rollout_advantages_and_returns
from miles_disagg.trainer.opd import rollout_reverse_kls
from miles_disagg.trainer.reduction import global_sample_mean, step_denominators, sum_over_ranks

ABS_DIFF = "train/train_rollout_logprob_abs_diff"


@dataclass
class FrozenInputs:
    """One micro-batch's inputs that stay fixed over the rollout's optimizer steps."""

    old: torch.Tensor | None
    """The behaviour logprobs (None: the training pass's own, detached; ``--skip-actor-forward-only``)."""
    recomputed: torch.Tensor | None
    """The trainer's recomputation of them (miles' ``log_probs``; None when that pass is skipped)."""
    ref: torch.Tensor | None
    advantages: torch.Tensor | None
    opd_reverse_kl: torch.Tensor | None = None
    """``--use-opd``: student minus teacher logprob per response token (:mod:`miles_disagg.trainer.opd`)."""
    returns: torch.Tensor | None = None
    """miles' ``returns``: the estimator's, before the OPD term and whitening (GAE's ``A + V`` for ppo,
    the advantages themselves otherwise; ``trainer.advantages``)."""


@dataclass
class RolloutInputs:
    micro: list[FrozenInputs]
    """One per micro-batch, in the order of the steps' micro-batches."""
    denominators: list[float]
    """Each step's global sample (or trained-token) count."""
    metrics: dict[str, float] = field(default_factory=dict)


def prepare_rollout(config, steps: Sequence[Sequence], recomputed: list, ref: list, group=None,
                    device: torch.device | str = "cpu") -> RolloutInputs:
    """``steps``: each optimizer step's ``PackedBatch`` micro-batches on this rank; ``recomputed`` and
    ``ref``: one entry per micro-batch (None where absent). Collective over ``group``."""
    flat = [batch for step in steps for batch in step]
    if config.use_rollout_logprobs:  # the engines' logprobs are the behaviour policy's (miles' meaning)
        old = [batch.rollout_logprobs.to(device) for batch in flat]
    else:
        old = list(recomputed)
    metrics = {}
    if all(o is not None for o in old):
        pairs = [((o - b.rollout_logprobs.to(o.device)).abs(), b.loss_mask) for o, b in zip(old, flat)]
        if config.calculate_per_token_loss:
            metrics[ABS_DIFF] = token_mean(pairs, flat, group, device)
        else:
            metrics[ABS_DIFF] = global_sample_mean(pairs, group, device)
    reverse_kls = rollout_reverse_kls(config, flat, old)
    if config.disable_compute_advantages_and_returns:
        advantages: list = [None] * len(flat)
        returns: list = [None] * len(flat)
    else:
        advantages, returns = rollout_advantages_and_returns(config, flat, old, ref, group, device,
                                                             opd_reverse_kls=reverse_kls)
    denominators = step_denominators(steps, per_token=config.calculate_per_token_loss, group=group, device=device)
    micro = [FrozenInputs(o, r, f, a, k, g) for o, r, f, a, k, g in
             zip(old, recomputed, ref, advantages, reverse_kls or [None] * len(flat), returns, strict=True)]
    return RolloutInputs(micro, denominators, metrics)


def token_mean(pairs: Sequence, batches: Sequence, group=None, device: torch.device | str = "cpu") -> float:
    """The sum of ``values`` over the trained tokens of every pair (all ranks of ``group``), divided
    as the per-token loss is: by the trained tokens, each sample's count clamped at 1 (miles)."""
    total = sum(float((values * mask.to(values.device)).sum()) for values, mask in pairs)
    count = float(sum(batch.num_tokens for batch in batches))
    total, count = sum_over_ranks([total, count], group, device)
    return total / count if count else 0.0
