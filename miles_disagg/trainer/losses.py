"""The PPO-style policy loss, KL estimators, TIS weights, and how per-token values become a loss.

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


def masked_sum(values: torch.Tensor, mask: torch.Tensor, *, per_token: bool) -> torch.Tensor:
    """A micro-batch's share of a step mean, before division by the step's global denominator.

    ``per_token``: the sum of ``values`` over the trained tokens. Otherwise the sum over samples
    of each sample's mean over its own trained tokens (a sample with none contributes 0 but
    still counts in the step's sample count, as in miles).
    The step's per-token denominator counts each sample's trained tokens clamped at 1
    (``PackedBatch.num_tokens``), as miles does.
    """
    if per_token:
        return (values * mask).sum()
    return ((values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()


@dataclass
class PolicyLoss:
    """Per-token terms of the clipped surrogate (reduce them with ``masked_sum``/``masked_mean``)."""

    per_token: torch.Tensor  # the pessimistic clipped surrogate, TIS-weighted when asked
    clipped: torch.Tensor  # 1.0 where the clipped branch is the binding one
    ppo_kl: torch.Tensor  # old - new logprob


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                *, eps_clip: float, eps_clip_high: float | None = None, eps_clip_c: float | None = None,
                token_weights: torch.Tensor | None = None) -> PolicyLoss:
    """PPO clipped surrogate, ratio clipped to ``[1 - eps_clip, 1 + eps_clip_high]``.

    ``advantages`` is per sample ``[batch]`` or per token; ``token_weights`` (TIS) multiply
    each token's loss and carry no gradient. ``eps_clip_c`` (miles' dual clip, > 1): where the
    advantage is negative the loss is at most ``-eps_clip_c * advantage``.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if eps_clip_c is not None:
        per_token = torch.where(adv < 0, torch.minimum(per_token, -eps_clip_c * adv), per_token)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    return PolicyLoss(per_token=per_token, clipped=(clipped > unclipped).float().detach(),
                      ppo_kl=(-log_ratio).detach())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str,
               importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference (miles' estimators).

    k1: ``log p - log q``; k2: ``(log p - log q)^2 / 2``; k3: ``exp(log q - log p) - (log q - log p) - 1``;
    low_var_kl: k3 clamped to [-10, 10] for stability. ``importance_ratio`` (``--use-unbiased-kl``:
    ``exp(logprob - old logprob)``) multiplies the estimate before the clamp.
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        kl = log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio.square()
    elif kind in ("k3", "low_var_kl"):
        kl = torch.exp(-log_ratio) + log_ratio - 1.0
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
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, None
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def rl_loss(config, batch, logprobs: torch.Tensor, entropy: torch.Tensor, old: torch.Tensor,
            ref: torch.Tensor | None, advantages: torch.Tensor,
            device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """One packed micro-batch's loss and metrics in sum form (``masked_sum``; every backend uses this).

    ``config`` is the ``TrainConfig`` (eps clips, TIS, entropy and KL coefficients, loss
    aggregation); ``batch`` a ``PackedBatch``; ``old`` the behaviour logprobs, ``ref`` the
    reference model's (None when no reference is loaded); ``advantages`` per token
    (``trainer.advantages.token_advantages``). Every metric is reduced like the loss, over the
    trained tokens only, so dividing by the step's global denominator gives the step's value.
    ``train/kl_loss`` is reported whenever ``--use-kl-loss`` is on, whatever its coefficient.
    """
    mask = batch.loss_mask.to(device)
    per_token = config.calculate_per_token_loss

    def reduce(values: torch.Tensor) -> torch.Tensor:
        return masked_sum(values, mask, per_token=per_token)

    weights = tis_weights(old, batch.rollout_logprobs.to(device), config.tis_clip,
                          config.tis_clip_low) if config.use_tis else None
    pg = policy_loss(logprobs, old, advantages.to(device), eps_clip=config.eps_clip,
                     eps_clip_high=config.eps_clip_high, eps_clip_c=config.eps_clip_c, token_weights=weights)
    pg_loss, entropy_sum = reduce(pg.per_token), reduce(entropy)
    loss = pg_loss - config.entropy_coef * entropy_sum
    metrics = {"train/pg_loss": pg_loss.item(), "train/pg_clipfrac": reduce(pg.clipped).item(),
               "train/ppo_kl": reduce(pg.ppo_kl).item(), "train/entropy": entropy_sum.item()}
    if config.use_kl_loss:
        if ref is None:
            raise ValueError("--use-kl-loss needs the reference model's logprobs")
        ratio = torch.exp(logprobs - old) if config.use_unbiased_kl else None
        kl = reduce(kl_penalty(logprobs, ref, config.kl_loss_type, ratio))
        loss = loss + config.kl_loss_coef * kl
        metrics["train/kl_loss"] = kl.item()
    if weights is not None:
        metrics["train/tis_weight_mean"] = reduce(weights).item()
    metrics["train/loss"] = loss.item()
    return loss, metrics
