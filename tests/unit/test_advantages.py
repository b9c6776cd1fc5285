"""Advantage estimators against hand-computed values: GRPO, REINFORCE++ (discounted per-token
returns, KL in the reward, reward at the last trained token), REINFORCE++-baseline (group
baseline), whitening over trained tokens; a GRPO ``--kl-coef`` is refused, and ``ppo`` (a critic,
``tests/unit/test_critic_gae.py``) on Megatron; ``ppo`` takes ``--kl-coef`` (``test_critic_config.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from miles_disagg.config import load_config
from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.advantages import (
    discounted_returns, last_trained_index, rollout_advantages, token_advantages, whiten,
)
from miles_disagg.trainer.sequence_advantages import assign_advantages, grpo_advantages
from miles_disagg.trainer.batches import pack
from miles_disagg.samples import Group, Sample
from miles_disagg.types import ConfigError


def group(index: int, rewards: list[float]) -> Group:
    return Group(index, [Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], reward=r)
                         for r in rewards])


def test_grpo_advantages_center_and_scale_each_group() -> None:
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]]
    adv = grpo_advantages(rewards)
    assert adv.dtype == "float32"
    assert abs(float(adv[0].mean())) < 1e-6 and abs(float(adv[0].std(ddof=1)) - 1.0) < 1e-4
    assert adv[1].tolist() == [0.0] * 4  # equal rewards: no signal
    assert grpo_advantages(rewards, normalize_by_std=False)[0].tolist() == [0.5, -0.5, -0.5, 0.5]
    # the same numbers as torch's float32 mean and unbiased std
    expected = torch.tensor(rewards)
    expected = (expected - expected.mean(1, keepdim=True)) / (expected.std(1, keepdim=True) + 1e-6)
    assert torch.equal(torch.from_numpy(adv), expected)
    with pytest.raises(ValueError, match="groups"):
        grpo_advantages([0.0] * 4)


@pytest.mark.parametrize("estimator, expected", [
    ("grpo", [1 / (math.sqrt(2) + 1e-6) * s for s in (1, -1)] + [(3 - 2) / (1 + 1e-6), 0.0, (1 - 2) / (1 + 1e-6)]),
    ("reinforce_plus_plus_baseline", [1.0, -1.0, 1.0, 0.0, -1.0]),
    ("reinforce_plus_plus", [2.0, 0.0, 3.0, 2.0, 1.0]),
])
def test_sequence_signal_of_each_estimator_on_ragged_groups(estimator: str, expected: list[float]) -> None:
    samples = assign_advantages([group(0, [2.0, 0.0]), group(1, [3.0, 2.0, 1.0])],
                                TrainConfig(advantage_estimator=estimator))
    assert [s.advantage for s in samples] == pytest.approx(expected, abs=1e-6)


def batch_of(rewards_and_masks, advantages=None):
    samples = [Sample(prompt_ids=[1], response_ids=[2] * len(mask), response_logprobs=[-1.0] * len(mask),
                      advantage=adv, loss_mask=mask) for adv, mask in rewards_and_masks]
    return pack(samples)


def test_reinforce_plus_plus_discounts_the_reward_from_the_last_trained_token() -> None:
    batch = batch_of([(1.0, [1, 1, 0, 0]), (2.0, [1, 1, 1])])
    old = torch.zeros(2, 4)
    adv = token_advantages(TrainConfig(advantage_estimator="reinforce_plus_plus", gamma=0.5), batch, old, None)
    # sample 0: reward at t=1 (its last trained token); t=2,3 (tool output) come after it: 0.
    # sample 1: reward at t=2; position 3 is padding.
    assert adv.tolist() == [[0.5, 1.0, 0.0, 0.0], [0.5, 1.0, 2.0, 0.0]]


def test_reinforce_plus_plus_with_kl_in_the_reward() -> None:
    batch = batch_of([(1.0, [1, 1, 1])])
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])  # k1 = old - ref = [0.5, 0, -0.5]
    config = TrainConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.1, kl_loss_type="k1", gamma=0.9)
    adv = token_advantages(config, batch, old, ref)
    # token rewards [-0.05, 0, 0.05 + 1]; G2 = 1.05, G1 = 0.9 * 1.05, G0 = -0.05 + 0.9 * G1
    assert adv[0].tolist() == pytest.approx([-0.05 + 0.9 * 0.945, 0.945, 1.05])
    with pytest.raises(ValueError, match="reference"):
        token_advantages(config, batch, old, None)


def test_reinforce_plus_plus_baseline_subtracts_the_kl_per_token() -> None:
    batch = batch_of([(0.5, [1, 0, 1])])  # the sample's reward minus its group's mean
    old = torch.tensor([[-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -0.5]])
    config = TrainConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=0.1, kl_loss_type="k1")
    assert token_advantages(config, batch, old, ref)[0].tolist() == pytest.approx([0.45, 0.5, 0.55])
    grpo = token_advantages(TrainConfig(), batch, old, None)
    assert grpo[0].tolist() == [0.5, 0.5, 0.5]


def test_whitening_over_trained_tokens_of_the_whole_rollout() -> None:
    a = torch.tensor([[1.0, 2.0, 99.0]])
    b = torch.tensor([[3.0, 4.0]])
    masks = [torch.tensor([[1.0, 1.0, 0.0]]), torch.tensor([[1.0, 1.0]])]
    out = whiten([a, b], masks)
    std = math.sqrt(5 / 3)  # unbiased variance of 1, 2, 3, 4 (99 is not trained)
    assert out[0][0, :2].tolist() == pytest.approx([(1 - 2.5) / std, (2 - 2.5) / std], rel=1e-6)
    assert out[1][0].tolist() == pytest.approx([(3 - 2.5) / std, (4 - 2.5) / std], rel=1e-6)
    with pytest.raises(ValueError, match="no trained token"):
        whiten([a], [torch.zeros(1, 3)])


def test_rollout_advantages_whiten_only_when_asked() -> None:
    batches = [batch_of([(1.0, [1, 1]), (-1.0, [1, 0])])]
    old = [torch.zeros(2, 2)]
    plain = rollout_advantages(TrainConfig(), batches, old, [None])
    assert plain[0].tolist() == [[1.0, 1.0], [-1.0, -1.0]]  # grpo: the signal on every response token
    whitened = rollout_advantages(TrainConfig(normalize_advantages=True), batches, old, [None])
    trained = whitened[0][batches[0].loss_mask.bool()]
    assert trained.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert trained.std().item() == pytest.approx(1.0, abs=1e-6)


def test_helpers() -> None:
    assert last_trained_index(torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])).tolist() == [2, -1]
    assert discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), 0.5).tolist() == [[1.5, 1.0, 2.0]]


def test_megatron_ppo_and_grpo_kl_coef_are_refused_at_config_time(tmp_path) -> None:
    with pytest.raises(ConfigError, match="--advantage-estimator ppo: the critic trains on --train-backend fsdp only"):
        load_config(["--advantage-estimator", "ppo"], "train_async")  # megatron, the default backend
    with pytest.raises(ConfigError, match="--kl-coef .*--use-kl-loss --kl-loss-coef"):
        load_config(["--kl-coef", "0.1"], "train_async")
    config, _ = load_config(["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.1", "--gamma", "0.9",
                             "--normalize-advantages", "--calculate-per-token-loss"], "train_async")
    train = config.train
    assert (train.kl_coef, train.gamma, train.normalize_advantages, train.calculate_per_token_loss) == (0.1, 0.9, True, True)
    assert train.needs_reference and TrainConfig(use_kl_loss=True, kl_loss_coef=0.0).needs_reference
    assert not TrainConfig().needs_reference
