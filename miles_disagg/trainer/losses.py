"""The PPO-style policy loss (token or GSPO's sequence ratio), KL estimators, TIS weights, and how
per-token values become a loss; ``policy_gradient.rl_loss`` assembles one micro-batch's loss from them.

All per-token tensors are ``[batch, response_len]``. ``loss_mask`` (``PackedBatch.loss_mask``)
is 1 on the tokens that are trained: real response tokens the policy generated (0 on padding
and on tokens it did not generate, e.g. tool output). ``logprobs`` are the current policy's;
``old_logprobs`` the policy that the advantages are measured against (the trainer's own
recomputation of the behaviour policy, so the first step's ratio is exactly 1);
``rollout_logprobs`` the engine's.

Aggregation (miles' meanings): an optimizer step's loss is the mean over the step's samples
of each sample's token-mean (default), or with ``--calculate-per-token-loss`` the mean over
all trained tokens of the step. Both are GLOBAL over the data-parallel ranks: a micro-batch
contributes ``masked_sum(...)`` and the backend divides by the step's global sample or token
count (``trainer.reduction``), so two ranks give exactly the gradient of one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_TYPES = ("low_var_kl", "k1", "k2", "k3")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where ``mask`` is 1 (0 when there are none)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, *, per_token: bool,
               denominator_mask: torch.Tensor | None = None) -> torch.Tensor:
    """A micro-batch's share of a step mean, before division by the step's global denominator.

    ``per_token``: the sum of ``values`` over the trained tokens. Otherwise the sum over samples
    of each sample's mean over its own trained tokens (a sample with none contributes 0 but
    still counts in the step's sample count, as in miles).
    The step's per-token denominator counts each sample's trained tokens clamped at 1
    (``PackedBatch.num_tokens``), as miles does.
    ``denominator_mask`` (default ``mask``): the tokens each sample's mean divides by, when a TIS
    function rejected some tokens (``mask`` then marks the tokens kept): miles keeps the original
    count there, so a rejected token counts as a 0.
    """
    if per_token:
        return (values * mask).sum()
    counts = (mask if denominator_mask is None else denominator_mask).sum(dim=-1).clamp(min=1)
    return ((values * mask).sum(dim=-1) / counts).sum()


LOG_RATIO_CLAMP = 20.0


def at_least_float32(values: torch.Tensor) -> torch.Tensor:
    """``values`` in float32, or float64 when they already are (half precision is upcast)."""
    return values if values.dtype == torch.float64 else values.float()


def safe_log_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """miles' guard before ``exp`` of a log-ratio: NaN becomes 0, and the value is clamped to
    ``[-20, 20]`` (infinities included), so ``exp`` stays below 4.9e8."""
    log_ratio = torch.nan_to_num(at_least_float32(log_ratio), nan=0.0, posinf=LOG_RATIO_CLAMP,
                                 neginf=-LOG_RATIO_CLAMP)
    return log_ratio.clamp(min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)


@dataclass
class PolicyLoss:
    """Per-token terms of the clipped surrogate (reduce them with ``masked_sum``/``masked_mean``)."""

    per_token: torch.Tensor  # the pessimistic clipped surrogate, TIS-weighted when asked
    clipped: torch.Tensor  # 1.0 where the clipped branch is the binding one
    ppo_kl: torch.Tensor  # old - new logprob (GSPO: the sequence's mean of it, on each of its tokens)


def clipped_surrogate(ppo_kl: torch.Tensor, advantages: torch.Tensor, *, eps_clip: float,
                      eps_clip_high: float | None = None,
                      eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """miles' ``compute_policy_loss``: per-token ``(loss, clipped)`` from ``ppo_kl = old - new``.

    The ratio is ``exp(-ppo_kl)`` with the log-ratio clamped to [-20, 20] (:func:`safe_log_ratio`),
    clipped to ``[1 - eps_clip, 1 + eps_clip_high]``; the loss is the larger (pessimistic) of
    ``-A * ratio`` and ``-A * clipped ratio``. ``eps_clip_c`` (dual clip, > 1): where ``A < 0`` the
    loss is at most ``-eps_clip_c * A``. ``clipped`` is 1.0 where the clipped branch binds.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(safe_log_ratio(-ppo_kl))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -eps_clip_c * advantages), per_token)
    return per_token, (clipped > unclipped).to(per_token.dtype).detach()


def sequence_ppo_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's ``ppo_kl``: each sample's mean of ``old - new`` over its trained tokens (0 with none),
    on every one of its tokens. ``exp(-it)`` is the geometric mean of the sample's token ratios,
    and the gradient flows to every trained token through the mean."""
    mask = mask.to(logprobs.dtype)
    per_sample = ((old_logprobs - logprobs) * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return per_sample.unsqueeze(-1).expand_as(logprobs)


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                *, eps_clip: float, eps_clip_high: float | None = None, eps_clip_c: float | None = None,
                token_weights: torch.Tensor | None = None, sequence_mask: torch.Tensor | None = None) -> PolicyLoss:
    """PPO clipped surrogate (:func:`clipped_surrogate`) of per-token (or per-sample ``[batch]``)
    ``advantages``; ``token_weights`` (TIS) multiply each token's loss and carry no gradient.

    ``sequence_mask`` (GSPO, ``--advantage-estimator gspo``): the ratio is the sequence-level one,
    the geometric mean of the token ratios over the tokens where the mask is 1
    (:func:`sequence_ppo_kl`), clipped as a whole.
    """
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    if sequence_mask is not None:
        ppo_kl = sequence_ppo_kl(logprobs, old_logprobs, sequence_mask)
    else:
        ppo_kl = old_logprobs - logprobs
    per_token, clipped = clipped_surrogate(ppo_kl, adv, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                                           eps_clip_c=eps_clip_c)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    return PolicyLoss(per_token=per_token, clipped=clipped, ppo_kl=ppo_kl.detach())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
               importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference (miles' ``compute_approx_kl``).

    k1: ``log p - log q``; k2: ``(log p - log q)^2 / 2``; k3: ``exp(log q - log p) - (log q - log p) - 1``;
    low_var_kl: k3 with ``log q - log p`` first clamped to [-20, 20] (:func:`safe_log_ratio`) and the
    estimate clamped to [-10, 10]. ``importance_ratio`` (``--use-unbiased-kl``:
    ``exp(logprob - old logprob)``) multiplies the estimate before the [-10, 10] clamp.
    """
    log_ratio = at_least_float32(logprobs) - at_least_float32(ref_logprobs)
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        reverse = -log_ratio if kind == "k3" else safe_log_ratio(-log_ratio)
        kl = torch.exp(reverse) - reverse - 1.0
    else:
        raise ValueError(f"unknown KL type {kind!r}; expected one of {KL_TYPES}")
    if importance_ratio is not None:
        kl = importance_ratio * kl
    return kl.clamp(min=-10.0, max=10.0) if kind == "low_var_kl" else kl


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, clip: float,
                clip_low: float = 0.0) -> torch.Tensor:
    """Truncated importance weights ``exp(old - rollout)`` clamped to ``[clip_low, clip]``: corrects
    for the engine's sampling policy differing from the trainer's (version lag, numerics)."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(min=clip_low, max=clip).detach()


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each chosen token and the entropy of each position's distribution."""
    log_probs = torch.log_softmax(at_least_float32(logits), dim=-1)
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, None
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy
