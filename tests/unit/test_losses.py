"""GRPO advantages, the clipped policy loss, KL estimators and TIS weights."""

from __future__ import annotations

import math

import pytest
import torch

from miles_disagg.trainer.losses import (
    grpo_advantages, kl_penalty, masked_mean, policy_loss, tis_weights, token_logprobs_and_entropy,
)


def test_grpo_advantages_center_and_scale_each_group() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    adv = grpo_advantages(rewards)
    assert torch.allclose(adv[0].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(adv[0].std(), torch.tensor(1.0), atol=1e-4)
    assert torch.equal(adv[1], torch.zeros(4))  # equal rewards: no signal
    assert torch.allclose(grpo_advantages(rewards, normalize_by_std=False)[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="groups"):
        grpo_advantages(torch.zeros(4))


def test_policy_loss_is_minus_advantage_on_policy() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.25], [0.1, 0.9]]))
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = policy_loss(logprobs, logprobs.clone(), torch.tensor([2.0, -1.0]), mask, eps_clip=0.2)
    assert math.isclose(out.loss.item(), (-2 - 2 + 1) / 3, rel_tol=1e-6)
    assert out.clipfrac.item() == 0.0 and out.ppo_kl.item() == 0.0


def test_policy_loss_clips_asymmetrically() -> None:
    old = torch.zeros(1, 1)
    mask = torch.ones(1, 1)
    high = policy_loss(torch.log(torch.tensor([[2.0]])), old, torch.tensor([1.0]), mask, eps_clip=0.2, eps_clip_high=0.28)
    assert math.isclose(high.loss.item(), -1.28, rel_tol=1e-6) and high.clipfrac.item() == 1.0
    low = policy_loss(torch.log(torch.tensor([[0.5]])), old, torch.tensor([-1.0]), mask, eps_clip=0.2, eps_clip_high=0.28)
    assert math.isclose(low.loss.item(), 0.8, rel_tol=1e-6)
    # a ratio moving the unfavourable way is never clipped (pessimistic bound)
    worse = policy_loss(torch.log(torch.tensor([[0.5]])), old, torch.tensor([1.0]), mask, eps_clip=0.2)
    assert math.isclose(worse.loss.item(), -0.5, rel_tol=1e-6) and worse.clipfrac.item() == 0.0


def test_policy_loss_gradient_and_token_weights() -> None:
    logprobs = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    weights = torch.tensor([[1.0, 0.0]])
    out = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0]), torch.ones(1, 2), eps_clip=0.2,
                      token_weights=weights)
    out.loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.5, 0.0]]))


def test_kl_estimators() -> None:
    p = torch.log(torch.tensor([0.5, 0.2]))
    q = torch.log(torch.tensor([0.25, 0.2]))
    assert torch.allclose(kl_penalty(p, q, "k1"), torch.tensor([math.log(2), 0.0]))
    assert torch.allclose(kl_penalty(p, q, "k2"), torch.tensor([0.5 * math.log(2) ** 2, 0.0]))
    assert torch.allclose(kl_penalty(p, q, "low_var_kl"), torch.tensor([0.5 - math.log(0.5) - 1, 0.0]))
    assert (kl_penalty(p, q, "low_var_kl") >= 0).all()
    with pytest.raises(ValueError, match="unknown KL type"):
        kl_penalty(p, q, "k9")


def test_tis_weights_truncate() -> None:
    old = torch.log(torch.tensor([0.5, 0.9, 0.1]))
    rollout = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    assert torch.allclose(tis_weights(old, rollout, clip=2.0), torch.tensor([1.0, 2.0, 0.5]))


def test_logprobs_entropy_and_masked_mean() -> None:
    logits = torch.tensor([[[0.0, 0.0], [10.0, -10.0]]])
    chosen, entropy = token_logprobs_and_entropy(logits, torch.tensor([[1, 0]]))
    assert torch.allclose(chosen, torch.tensor([[math.log(0.5), 0.0]]), atol=1e-6)
    assert math.isclose(entropy[0, 0].item(), math.log(2), rel_tol=1e-6) and entropy[0, 1].item() < 1e-6
    assert masked_mean(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 0.0])).item() == 1.0
    assert masked_mean(torch.tensor([1.0]), torch.tensor([0.0])).item() == 0.0
