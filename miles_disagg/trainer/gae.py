"""PPO with a critic (``--advantage-estimator ppo``): GAE and the clipped value loss, as miles defines them.

All per-token tensors are ``[batch, response]``, right-padded (``PackedBatch``'s layout).

GAE runs over each sample's TRAINED tokens only (miles after its PR #1827: its
``get_advantages_and_returns_batch`` compresses every sample to the tokens whose loss mask is 1).
A token outside the loss mask (a tool's output in a multi-turn sample, padding) is no step of the
decision process: it carries no reward (no KL shaping either), adds no value delta, gets advantage
and return 0, and the recursion crosses it without a ``gamma * lambd`` decay, the next trained
token's value being the bootstrap. Over the trained tokens ``t`` (``t+1``: the next trained one)::

    r_t     = -kl_coef * KL_t  (+ the sample's reward on its LAST TRAINED token)
    delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last trained token: 0)
    A_t     = delta_t + gamma * lambd * A_{t+1}
    R_t     = A_t + V_t                            (the critic's targets: "returns")

``KL_t`` is the ``--kl-loss-type`` estimate of the behaviour logprobs against the reference's
(``--kl-coef``, miles' reward shaping); a sample without trained tokens gets all zeros (its reward
is dropped). With a loss mask of all ones this is the plain recursion over every response token
with the reward on the last one (miles before #1827).

The value loss (miles' ``value_loss_function``), per token::

    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
    loss_t = max((V_clip - R)^2, (V - R)^2)
    clipped_t = |V - V_old| > value_clip      (the ``value_clipfrac`` metric)

reduced like the policy loss (``losses.masked_sum`` over the trained tokens: per-sample token
means, or per token with ``--calculate-per-token-loss``), divided by the step's global count.
"""

from __future__ import annotations

import torch


def last_trained_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """``[batch]`` index of each row's last 1 in ``loss_mask`` (-1 for a row without any)."""
    positions = torch.arange(loss_mask.shape[-1], device=loss_mask.device).expand_as(loss_mask)
    return torch.where(loss_mask > 0, positions, torch.full_like(positions, -1)).max(dim=-1).values


def token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """``[batch]`` sequence rewards -> ``[batch, response]`` token rewards: ``-kl_coef * kl`` on the
    trained tokens, plus each reward on its row's last trained token (0 elsewhere; a row without
    trained tokens gets none)."""
    trained = (loss_mask > 0).to(rewards.dtype)
    shaped = torch.zeros_like(trained) if kl is None or kl_coef == 0 else -kl_coef * kl.to(rewards.dtype) * trained
    last = last_trained_index(loss_mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    shaped[rows, last[rows]] += rewards[rows]
    return shaped


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float,
        trained: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of ``[batch, T]`` token rewards and values over the tokens where
    ``trained`` is 1 (every token when None), the others skipped and given 0 (module docstring)."""
    if rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} differ in shape")
    keep = torch.ones_like(values, dtype=torch.bool) if trained is None else trained.to(values.device) > 0
    if keep.shape != values.shape:
        raise ValueError(f"the loss mask {tuple(keep.shape)} and values {tuple(values.shape)} differ in shape")
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[..., 0])
    next_value = torch.zeros_like(running)
    for t in reversed(range(values.shape[-1])):
        step = rewards[..., t] + gamma * next_value - values[..., t] + gamma * lambd * running
        here = keep[..., t]
        running = torch.where(here, step, running)
        next_value = torch.where(here, values[..., t], next_value)
        advantages[..., t] = torch.where(here, step, torch.zeros_like(step))
    returns = torch.where(keep, advantages + values, torch.zeros_like(values))
    return advantages, returns


def ppo_advantages_and_returns(batch, values: torch.Tensor, gamma: float, lambd: float,
                               device: torch.device | str | None = None, kl: torch.Tensor | None = None,
                               kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE ``(advantages, returns)`` of one ``PackedBatch`` scored with the critic's ``values``
    ``[batch, response]``, in their dtype, over its trained tokens; the rewards are the samples'
    (``batch.advantages``, the raw reward for ppo), shaped by ``-kl_coef * kl`` (``kl``:
    ``[batch, response]``, or None). Both are 0 off the trained tokens and carry no gradient."""
    device = device or values.device
    values = values.detach().to(device)
    trained = batch.loss_mask.to(device, values.dtype)
    kl = None if kl is None else kl.detach().to(device, values.dtype)
    rewards = token_rewards(batch.advantages.to(device, values.dtype), trained, kl, kl_coef)
    return gae(rewards, values * trained, gamma, lambd, trained)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       value_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(loss, clipped)``: the larger of the clipped and unclipped squared errors, and
    1.0 where the new value moved more than ``value_clip`` from the old one (no gradient)."""
    old_values, returns = old_values.detach(), returns.detach()
    moved = values - old_values
    clipped_values = old_values + moved.clamp(-value_clip, value_clip)
    loss = torch.maximum((clipped_values - returns).square(), (values - returns).square())
    return loss, (moved.abs() > value_clip).to(loss.dtype).detach()


def explained_variance_sums(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """``[count, sum R, sum R^2, sum (R - V), sum (R - V)^2]`` over the tokens where ``mask`` is 1:
    summed over micro-batches and ranks, :func:`explained_variance` of them."""
    mask = mask.to(torch.float64)
    returns, residual = returns.double() * mask, (returns.double() - values.double()) * mask
    return [float(mask.sum()), float(returns.sum()), float(returns.square().sum()), float(residual.sum()),
            float(residual.square().sum())]


def explained_variance(sums: list[float]) -> float:
    """``1 - Var(R - V) / Var(R)`` of :func:`explained_variance_sums` (0 when Var(R) is 0)."""
    count, total, total_sq, residual, residual_sq = sums
    if count <= 0:
        return 0.0
    var_returns = total_sq / count - (total / count) ** 2
    var_residual = residual_sq / count - (residual / count) ** 2
    return 1.0 - var_residual / var_returns if var_returns > 1e-12 else 0.0
