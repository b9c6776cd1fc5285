"""On-policy distillation (miles' ``--use-opd``): the teacher's term in the advantages.

The rollout has each sample's tokens scored by the teacher engine (:mod:`miles_disagg.rollout.teacher`:
``Sample.teacher_logprobs``, the teacher's logprob of every response token). miles' term, per
response token ``t`` of a sample:

    reverse_kl_t = student_t - teacher_t
    advantage_t <- advantage_t - opd_kl_coef * reverse_kl_t

where ``student_t`` is the logprob the advantages are computed from (miles' ``log_probs``: the
engines' with ``--use-rollout-logprobs``, else the trainer's recomputed behaviour logprobs), applied
after the ``--advantage-estimator``'s advantages and before ``--normalize-advantages`` whitens them,
on every response token (tokens outside the loss mask are not trained either way). With top-k OPD
(``--opd-log-prob-top-k``) ``reverse_kl_t`` is instead the term the rollout computed over each
position's top-k token set (``Sample.opd_reverse_kl``, :mod:`miles_disagg.rollout.opd_topk`: the
strategies and weight modes), taken as is, as miles takes its precomputed ``opd_reverse_kl``. The policy loss
then trains on those advantages as it does on any others. ``train/opd_reverse_kl`` is the reverse KL
reduced as the loss is (each sample's mean over its trained tokens, or the token mean with
``--calculate-per-token-loss``), as miles logs it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from miles_disagg.trainer.losses import masked_sum

METRIC = "train/opd_reverse_kl"


def reverse_kl(batch, student: torch.Tensor) -> torch.Tensor:
    """``[batch, response]`` ``student - teacher`` of one ``PackedBatch`` (0 on padding), or with top-k
    OPD the samples' precomputed terms (miles takes those first); ``ValueError`` when its samples carry
    neither."""
    mask = batch.response_mask.to(student.device, student.dtype)
    if batch.opd_reverse_kl is not None:
        return batch.opd_reverse_kl.to(student.device, student.dtype) * mask
    if batch.teacher_logprobs is None:
        raise ValueError("--use-opd: these samples carry no teacher logprobs (Sample.teacher_logprobs); the rollout "
                         "scores every sample with the teacher, and a custom rollout or saved data must keep them")
    teacher = batch.teacher_logprobs.to(student.device, student.dtype)
    return (student - teacher) * mask


def rollout_reverse_kls(config, batches: Sequence, student: Sequence) -> list[torch.Tensor] | None:
    """Each micro-batch's reverse KL with ``--use-opd`` (None without): ``student`` is one logprob
    tensor per micro-batch (``ValueError`` where it is missing: the skipped forward pass)."""
    if not getattr(config, "use_opd", False):
        return None
    if any(s is None for s in student):
        raise ValueError("--use-opd needs the student's logprobs before training (--skip-actor-forward-only without "
                         "--use-rollout-logprobs gives none)")
    return [reverse_kl(batch, s) for batch, s in zip(batches, student, strict=True)]


def apply_to_advantages(advantages: Sequence[torch.Tensor], reverse_kls: Sequence[torch.Tensor],
                        kl_coef: float) -> list[torch.Tensor]:
    """miles' ``apply_opd_kl_to_advantages``: ``advantage - opd_kl_coef * reverse_kl``, token by token."""
    return [adv - kl_coef * kl.to(adv.device, adv.dtype) for adv, kl in zip(advantages, reverse_kls, strict=True)]


def metrics(config, batch, kl: torch.Tensor | None, device: torch.device) -> dict[str, float]:
    """``train/opd_reverse_kl`` of one micro-batch in sum form (reduced as the loss: per sample, or per
    token with ``--calculate-per-token-loss``); empty without ``--use-opd``."""
    if kl is None:
        return {}
    total = masked_sum(kl.to(device), batch.loss_mask.to(device), per_token=config.calculate_per_token_loss)
    return {METRIC: float(total)}
