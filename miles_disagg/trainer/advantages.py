"""Advantage estimators (``--advantage-estimator``), with miles' meanings, in two halves.

Driver side, before the batch is dealt to the ranks (miles' reward post-processing):
``sequence_advantages.assign_advantages`` (torch-free, as the driver is) sets each sample's
sequence-level signal ``Sample.advantage`` from its group's rewards:
- ``grpo`` and ``gspo``: reward minus the group's mean, divided by the group's std + 1e-6 (a group
  of one, or of equal rewards, gets 0; miles' ``--disable-grpo-std-normalization``: not divided;
  ``--disable-rewards-normalization``: the raw reward, for reinforce_plus_plus_baseline too);
- ``reinforce_plus_plus_baseline``: reward minus the group's mean (the group baseline);
- ``reinforce_plus_plus``: the raw reward.

Trainer side, once the behaviour (``old``) and reference logprobs are known:
``token_advantages`` turns it into per-token advantages ``[batch, response]``:
- ``grpo`` and ``gspo``: the signal on every response token (GSPO differs in the loss's ratio:
  ``losses.sequence_ppo_kl``);
- ``reinforce_plus_plus``: discounted returns ``G_t = r_t + gamma * G_{t+1}`` of the token
  rewards ``r_t = -kl_coef * KL_t``, with the sample's reward added at its LAST TRAINED token
  (``--gamma``, ``--kl-coef``; ``KL_t`` is the ``--kl-loss-type`` estimate of old vs reference);
- ``reinforce_plus_plus_baseline``: ``signal - kl_coef * KL_t`` on every token.
- ``ppo``: GAE over the critic's values (``PackedBatch.values``) with ``--gamma``/``--lambd``, run
  over the TRAINED tokens only, the reward at the last trained token and ``-kl_coef * KL_t`` on
  each trained token (``--kl-coef``, miles' reward shaping; ``trainer.gae``).
For the other estimators, as in miles, the KL shaping runs over every response token (trained or
not), and a sample without trained tokens gets no reward placed (it receives no gradient either way).

Each estimator also gives miles' ``returns`` (what a ``--loss-type custom_loss`` reads as
``batch["returns"]``): the advantages themselves for grpo, gspo and the two reinforce_plus_plus
estimators, GAE's returns ``A + V`` for ppo; both before the two steps below.
On-policy distillation (``--use-opd``) then subtracts its reverse-KL term token by token
(:mod:`miles_disagg.trainer.opd`), and ``--normalize-advantages`` whitens them over the trained tokens of the whole rollout,
across data-parallel ranks (``whiten``): ``(A - mean) / sqrt(var + 1e-8)``, unbiased variance.
"""

from __future__ import annotations

import torch

from miles_disagg.trainer.gae import last_trained_index, ppo_advantages_and_returns
from miles_disagg.trainer.losses import kl_penalty
from miles_disagg.trainer.opd import apply_to_advantages
from miles_disagg.trainer.reduction import all_reduce_sum

WHITEN_EPS = 1e-8


def token_advantages(config, batch, old: torch.Tensor | None, ref: torch.Tensor | None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Per-token advantages ``[batch, response]`` of one ``PackedBatch`` (before whitening; 0 on padding)."""
    return token_advantages_and_returns(config, batch, old, ref, device)[0]


def token_advantages_and_returns(config, batch, old: torch.Tensor | None, ref: torch.Tensor | None,
                                 device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` ``[batch, response]`` of one ``PackedBatch``, before OPD and whitening.

    ``old`` may be None (``--skip-actor-forward-only``) when no KL shapes the reward; ``device``:
    where the result lives (default ``old``'s device)."""
    device = old.device if old is not None else device or "cpu"
    response = batch.response_mask.to(device)
    signal = batch.advantages.to(device).unsqueeze(-1)
    estimator = config.advantage_estimator
    if estimator in ("grpo", "gspo"):
        return _same(signal * response)
    if old is None:
        old = torch.zeros_like(response)
    kl = _reward_kl(config, old, ref) * response
    if estimator == "ppo":
        return _ppo_advantages(config, batch, kl, device)
    if estimator == "reinforce_plus_plus_baseline":
        return _same((signal - config.kl_coef * kl) * response)
    if estimator == "reinforce_plus_plus":
        token_rewards = -config.kl_coef * kl
        last = last_trained_index(batch.loss_mask.to(old.device))
        rows = torch.nonzero(last >= 0).squeeze(-1)
        token_rewards[rows, last[rows]] += signal[rows, 0]
        return _same(discounted_returns(token_rewards, config.gamma) * response)
    raise ValueError(f"unsupported --advantage-estimator {estimator!r}")


def _same(advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """miles' returns of the estimators without a critic: the advantages themselves (a copy)."""
    return advantages, advantages.clone()


def _ppo_advantages(config, batch, kl: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.values is None:
        raise ValueError("--advantage-estimator ppo: the batch carries no critic values (trainer.critic_values)")
    return ppo_advantages_and_returns(batch, batch.values, config.gamma, config.lambd, device, kl=kl,
                                      kl_coef=config.kl_coef)


def _reward_kl(config, old: torch.Tensor, ref: torch.Tensor | None) -> torch.Tensor:
    if config.kl_coef == 0:
        return torch.zeros_like(old)
    if ref is None:
        raise ValueError("--kl-coef needs the reference model's logprobs")
    return kl_penalty(old, ref, config.kl_loss_type)


def discounted_returns(rewards: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_{t+1}`` along the last dimension (``G`` after the end is 0)."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in reversed(range(rewards.shape[-1])):
        running = rewards[..., t] + gamma * running
        returns[..., t] = running
    return returns


def whiten(advantages: list[torch.Tensor], masks: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Whiten ``advantages`` with the mean and (unbiased) variance over every token where ``masks``
    is 1, in all of them and on every rank of ``group`` (collective); ``ValueError`` when no token is."""
    device = advantages[0].device if advantages else torch.device("cpu")
    stats = torch.zeros(3, dtype=torch.float64, device=device)
    for adv, mask in zip(advantages, masks, strict=True):
        mask = mask.to(adv.device, torch.float64)
        values = adv.double()
        stats += torch.stack([(values * mask).sum(), (values.square() * mask).sum(), mask.sum()])
    total, total_sq, count = all_reduce_sum(stats, group).tolist()  # on the advantages' device (nccl: CUDA)
    if count == 0:
        raise ValueError("--normalize-advantages: the rollout has no trained token to whiten over")
    mean = total / count
    var = total_sq / count - mean * mean
    if count >= 2:
        var *= count / (count - 1)
    scale = (max(var, 0.0) + WHITEN_EPS) ** -0.5
    return [(adv - mean) * scale for adv in advantages]


def rollout_advantages(config, batches: list, old: list, ref: list, group=None,
                       device: torch.device | str | None = None,
                       opd_reverse_kls: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The advantages of :func:`rollout_advantages_and_returns`."""
    return rollout_advantages_and_returns(config, batches, old, ref, group, device, opd_reverse_kls)[0]


def rollout_advantages_and_returns(config, batches: list, old: list, ref: list, group=None,
                                   device: torch.device | str | None = None,
                                   opd_reverse_kls: list[torch.Tensor] | None = None,
                                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per-token ``(advantages, returns)`` of every micro-batch of one rollout on this rank: the
    advantages less the on-policy distillation term (``--use-opd``: ``opd_reverse_kls``,
    :mod:`miles_disagg.trainer.opd`), whitened over the whole rollout (all ranks of ``group``;
    collective) when ``--normalize-advantages``; the returns as the estimator gave them (miles')."""
    pairs = [token_advantages_and_returns(config, b, o, r, device) for b, o, r in zip(batches, old, ref, strict=True)]
    advantages, returns = [a for a, _ in pairs], [r for _, r in pairs]
    if opd_reverse_kls is not None:
        advantages = apply_to_advantages(advantages, opd_reverse_kls, config.opd_kl_coef)
    if config.normalize_advantages:
        advantages = whiten(advantages, [b.loss_mask for b in batches], group)
    return advantages, returns
