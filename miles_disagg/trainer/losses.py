"""Advantages (GRPO) and the PPO-style policy loss, token-level and masked.

All per-token tensors are ``[batch, response_len]`` with a 0/1 ``mask`` marking real
response tokens. ``logprobs`` are the current policy's; ``old_logprobs`` the policy that
the advantages are measured against (the trainer's own recomputation of the behaviour
policy, so the first step's ratio is exactly 1); ``rollout_logprobs`` the engine's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_TYPES = ("low_var_kl", "k1", "k2")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the tokens where ``mask`` is 1 (0 when there are none)."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def grpo_advantages(rewards: torch.Tensor, *, normalize_by_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """``[groups, n]`` rewards -> ``[groups, n]`` advantages: reward minus its group's mean,
    divided by the group's std when ``normalize_by_std`` (a group of equal rewards gets 0)."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_by_std or rewards.shape[1] < 2:
        return centered
    return centered / (rewards.std(dim=1, keepdim=True) + eps)


def assign_advantages(groups: list, config) -> list:
    """Each sample's advantage from its group's rewards (``--advantage-estimator``); the samples
    in order. GRPO: reward minus the group's mean (over the group's std); otherwise reward minus
    the batch mean (a global baseline)."""
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    if config.advantage_estimator == "grpo":
        adv = grpo_advantages(rewards, normalize_by_std=config.normalize_advantages_by_std)
    else:
        adv = rewards - rewards.mean()
    samples = []
    for g, row in zip(groups, adv.tolist()):
        for s, a in zip(g.samples, row):
            s.advantage = float(a)
            samples.append(s)
    return samples


@dataclass
class PolicyLoss:
    loss: torch.Tensor
    clipfrac: torch.Tensor
    ppo_kl: torch.Tensor


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                *, eps_clip: float, eps_clip_high: float | None = None,
                token_weights: torch.Tensor | None = None) -> PolicyLoss:
    """PPO clipped surrogate, ratio clipped to ``[1 - eps_clip, 1 + eps_clip_high]``.

    ``advantages`` is per sample ``[batch]`` or per token; ``token_weights`` (TIS) multiply
    each token's loss and carry no gradient. ``ppo_kl`` is the mean of ``old - new`` logprob.
    """
    high = eps_clip if eps_clip_high is None else eps_clip_high
    adv = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages
    log_ratio = logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    per_token = torch.maximum(unclipped, clipped)
    if token_weights is not None:
        per_token = per_token * token_weights.detach()
    clipfrac = masked_mean((clipped > unclipped).float(), mask)
    return PolicyLoss(loss=masked_mean(per_token, mask), clipfrac=clipfrac.detach(),
                      ppo_kl=masked_mean(-log_ratio, mask).detach())


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference.

    k1: ``log p - log q``; k2: ``(log p - log q)^2 / 2``; low_var_kl (k3):
    ``exp(log q - log p) - (log q - log p) - 1``, clamped to [-10, 10] for stability.
    """
    log_ratio = logprobs - ref_logprobs
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        neg = -log_ratio
        return (torch.exp(neg) - neg - 1.0).clamp(min=-10.0, max=10.0)
    raise ValueError(f"unknown KL type {kind!r}; expected one of {KL_TYPES}")


def tis_weights(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, clip: float) -> torch.Tensor:
    """Truncated importance weights ``min(exp(old - rollout), clip)``: corrects for the engine's
    sampling policy differing from the trainer's (version lag, numerics)."""
    return torch.exp(old_logprobs - rollout_logprobs).clamp(max=clip).detach()


def token_logprobs_and_entropy(logits: torch.Tensor, tokens: torch.Tensor,
                               with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprob of each chosen token and the entropy of each position's distribution."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    chosen = log_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return chosen, None
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return chosen, entropy


def rl_token_loss(config, batch, logprobs: torch.Tensor, entropy: torch.Tensor, old: torch.Tensor,
                  ref: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean loss of one packed micro-batch (every backend uses this) and its metrics.

    ``config`` is the ``TrainConfig`` (eps clips, TIS, entropy and KL coefficients); ``batch``
    a ``PackedBatch``; ``old`` the behaviour logprobs, ``ref`` the reference model's (or None).
    """
    mask = batch.response_mask.to(device)
    weights = tis_weights(old, batch.rollout_logprobs.to(device), config.tis_clip) if config.use_tis else None
    pg = policy_loss(logprobs, old, batch.advantages.to(device), mask, eps_clip=config.eps_clip,
                     eps_clip_high=config.eps_clip_high, token_weights=weights)
    entropy_mean = masked_mean(entropy, mask)
    loss = pg.loss - config.entropy_coef * entropy_mean
    metrics = {"train/pg_loss": pg.loss.item(), "train/pg_clipfrac": pg.clipfrac.item(),
               "train/ppo_kl": pg.ppo_kl.item(), "train/entropy": entropy_mean.item()}
    if ref is not None:
        kl = masked_mean(kl_penalty(logprobs, ref, config.kl_loss_type), mask)
        loss = loss + config.kl_loss_coef * kl
        metrics["train/kl_loss"] = kl.item()
    if weights is not None:
        metrics["train/tis_weight_mean"] = masked_mean(weights, mask).item()
    metrics["train/loss"] = loss.item()
    return loss, metrics
