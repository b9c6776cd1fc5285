"""PPO with a critic (``--advantage-estimator ppo``): GAE and the clipped value loss, as miles defines them.

All per-token tensors are ``[batch, response]``, right-padded (``PackedBatch``'s layout).

Token rewards (miles' ``compute_advantages`` for ppo): ``-kl_coef * KL_t`` on every response
token (KL shaping; ``--kl-coef`` with ppo is refused by the config here, so 0) plus the sample's
reward at its LAST RESPONSE token (not its last trained one: miles adds it at index -1).

GAE (miles' ``vanilla_gae``/``chunked_gae``, both the same recursion) over every response
token, the value after the last one being 0::

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambd * A_{t+1}
    R_t     = A_t + V_t                      (the critic's targets: "returns")

Right padding is exact: with rewards and values 0 on padding, each row's advantages are those of
its own response alone.

The value loss (miles' ``value_loss_function``), per token::

    V_clip = V_old + clamp(V - V_old, -value_clip, value_clip)
    loss_t = max((V_clip - R)^2, (V - R)^2)
    clipped_t = |V - V_old| > value_clip      (the ``value_clipfrac`` metric)

reduced like the policy loss (``losses.masked_sum`` over the trained tokens: per-sample token
means, or per token with ``--calculate-per-token-loss``), divided by the step's global count.
"""

from __future__ import annotations

import torch


def token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor, kl: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """``[batch]`` sequence rewards -> ``[batch, response]`` token rewards: ``-kl_coef * kl`` on the
    response tokens, plus each reward on its row's last response token (0 on padding)."""
    response = response_mask.to(rewards.dtype)
    shaped = torch.zeros_like(response) if kl is None or kl_coef == 0 else -kl_coef * kl.to(rewards.dtype) * response
    last = (response.sum(dim=-1).long() - 1).clamp(min=0)
    rows = torch.arange(response.shape[0], device=response.device)
    shaped[rows, last] += rewards * (response.sum(dim=-1) > 0).to(rewards.dtype)
    return shaped


def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)`` of ``[batch, T]`` token rewards and values (the value after T is 0)."""
    if rewards.shape != values.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and values {tuple(values.shape)} differ in shape")
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[..., 0])
    length = values.shape[-1]
    for t in reversed(range(length)):
        next_value = values[..., t + 1] if t + 1 < length else torch.zeros_like(running)
        delta = rewards[..., t] + gamma * next_value - values[..., t]
        running = delta + gamma * lambd * running
        advantages[..., t] = running
    return advantages, advantages + values


def ppo_advantages_and_returns(batch, values: torch.Tensor, gamma: float, lambd: float,
                               device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE ``(advantages, returns)`` of one ``PackedBatch`` scored with the critic's ``values``
    ``[batch, response]``, in their dtype; the rewards are the samples' (``batch.advantages``, the raw
    reward for ppo). Both are 0 on padding and carry no gradient."""
    device = device or values.device
    values = values.detach().to(device)
    response = batch.response_mask.to(device, values.dtype)
    values = values * response
    rewards = token_rewards(batch.advantages.to(device, values.dtype), response)
    advantages, returns = gae(rewards, values, gamma, lambd)
    return advantages * response, returns * response


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
