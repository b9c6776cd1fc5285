"""Loss hooks written the way miles' examples write them (``examples/DrGRPO/custom_reducer.py``,
``examples/async_icepop/reinforce_icepop_loss.py``, ``examples/train_infer_mismatch_helper/mis.py``):
miles' import paths, miles' signatures, miles' layout. Loaded by dotted path in
``test_miles_loss_hooks.py``, never imported directly (``miles.*`` is served by the trainer)."""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Callable
from typing import Any

import torch

from miles.backends.megatron_utils.loss import get_log_probs_and_entropy, policy_loss_function
from miles.backends.training_utils.parallel import ParallelState
from miles.utils.ppo_utils import compute_approx_kl
from miles.utils.types import RolloutBatch

DIVISOR = 1000.0


def get_pg_loss_reducer(
    total_lengths: list[int],
    response_lengths: list[int],
    loss_masks: list[torch.Tensor],
    calculate_per_token_loss: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Dr.GRPO: each sample's masked sum divided by a constant instead of its token count."""
    if calculate_per_token_loss:
        def sum_of_token(x: torch.Tensor) -> torch.Tensor:
            return sum((x_i * m).sum() for x_i, m in zip(x.split(response_lengths, dim=0), loss_masks))

        return sum_of_token

    def sum_of_sample_mean(x: torch.Tensor) -> torch.Tensor:
        return sum((x_i * m).sum() / DIVISOR for x_i, m in zip(x.split(response_lengths, dim=0), loss_masks))

    return sum_of_sample_mean


def reinforce_icepop_loss(
    args: Namespace,
    parallel_state: ParallelState,
    batch: RolloutBatch,
    logits: torch.Tensor,
    sum_of_sample_mean: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """REINFORCE with double-sided IS masking against the engines' logprobs (miles' newer 5-argument form)."""
    advantages = torch.cat(batch["advantages"], dim=0)
    rollout_log_probs = torch.cat(batch["rollout_log_probs"], dim=0)
    out = get_log_probs_and_entropy(
        logits, args=args, parallel_state=parallel_state, unconcat_tokens=batch["unconcat_tokens"],
        total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"], with_entropy=True,
        max_seq_lens=batch.get("max_seq_lens", None))
    log_probs = torch.cat(out["log_probs"], dim=0)
    r = torch.exp(log_probs - rollout_log_probs)
    in_range = (r > 1 - args.eps_clip) & (r < 1 + args.eps_clip_high)
    f_r = torch.where(in_range, r, torch.zeros_like(r))
    pg_loss = sum_of_sample_mean(-(f_r.detach() * advantages * log_probs))
    entropy_loss = sum_of_sample_mean(torch.cat(out["entropy"], dim=0))
    loss = pg_loss - args.entropy_coef * entropy_loss
    return loss, {"loss": loss.clone().detach(), "pg_loss": pg_loss.clone().detach(),
                  "mask_frac": sum_of_sample_mean((~in_range).float()).clone().detach()}


def policy_plus_kl_to_rollout(args, batch, logits, sum_of_sample_mean):
    """miles' policy loss plus a k3 penalty towards the engines' policy (the 4-argument form)."""
    loss, metrics = policy_loss_function(args, batch, logits, sum_of_sample_mean)
    out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                    total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
    kl = compute_approx_kl(torch.cat(out["log_probs"]), torch.cat(batch["rollout_log_probs"]), kl_loss_type="k3")
    penalty = sum_of_sample_mean(kl)
    metrics["rollout_kl"] = penalty.detach()
    return loss + 0.5 * penalty, metrics


def plain_policy_loss(args, batch, logits, sum_of_sample_mean):
    """Exactly miles' policy loss, as a custom loss."""
    return policy_loss_function(args, batch, logits, sum_of_sample_mean)


def truncate_and_mask(
    args,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    """Token TIS truncated at 2, and rejection (mask) of tokens whose ratio is below 0.5."""
    weights, masks, below = [], [], []
    for train, rollout, mask in zip(train_log_probs, rollout_log_probs, loss_masks):
        ratio = torch.exp(torch.clamp(train - rollout, min=-20.0, max=20.0))
        weights.append(ratio.clamp(0, 2.0) * mask)
        keep = (ratio >= 0.5).float()
        masks.append(mask * keep)
        below.append(1 - keep)
    metrics = {"rejected_fraction": below}  # mis.py's form: a list of per-sample tensors
    return pg_loss * torch.cat(weights).detach(), masks, metrics


def not_a_reducer(total_lengths, response_lengths):
    return None


async def async_loss(args, batch, logits, sum_of_sample_mean):
    return None
