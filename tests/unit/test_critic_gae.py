"""PPO with a critic: GAE and the clipped value loss against an independent float64 implementation of
miles' formulas in plain Python floats (``get_advantages_and_returns_batch`` after miles #1827: over
each sample's trained tokens only, the reward at its last trained token,
``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lambd A_{t+1}`` with ``t+1`` the next
trained token, ``R = A + V``, 0 off the trained tokens; a hand-computed ragged case; with a loss mask
of all ones the recursion of miles before #1827; ``value_loss_function``:
``max((V_old + clip(V - V_old) - R)^2, (V - R)^2)``, the
clip fraction ``|V - V_old| > value_clip``, both reduced by ``sum_of_sample_mean``), per sample and
per token, and the batch split over two "ranks" (sum form over the global count) equal to one."""

from __future__ import annotations

import math

import pytest
import torch

from miles_disagg.config.components import TrainConfig
from miles_disagg.loop.critic import merge_results
from miles_disagg.trainer.advantages import rollout_advantages, token_advantages_and_returns
from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.critic_values import attach_values, values_of
from miles_disagg.trainer.gae import (
    clipped_value_loss, explained_variance, explained_variance_sums, gae, ppo_advantages_and_returns,
)
from miles_disagg.trainer.losses import masked_sum
from miles_disagg.trainer.reduction import step_denominators
from miles_disagg.trainer.results import TrainResult
from miles_disagg.trainer.sequence_advantages import assign_advantages
from miles_disagg.samples import Group, Sample

MASKS = [[1, 1, 0, 1, 1], [1, 1, 1], [0, 0], [1, 0, 1, 1, 0, 1], [1]]
REWARDS = [1.0, -0.5, 0.25, 0.8, 0.0]
SETTINGS = [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0), (1.0, 0.7)]


def scored(seed: int = 0):
    """Ragged samples (tool tokens, a sample without trained tokens), float64 rewards and values."""
    generator = torch.Generator().manual_seed(seed)
    samples = [Sample(prompt_ids=[1, 2, 3][: 1 + i % 3], response_ids=[4] * len(mask), loss_mask=mask,
                      advantage=REWARDS[i]) for i, mask in enumerate(MASKS)]
    values = [torch.randn(len(m), generator=generator, dtype=torch.float64).tolist() for m in MASKS]
    rewards = (torch.tensor(REWARDS, dtype=torch.float64) + 0.1 * torch.rand(len(MASKS), generator=generator,
                                                                              dtype=torch.float64)).tolist()
    return samples, rewards, values


def as_batch(samples, rewards, values):
    """``pack`` with float64 rewards and values (``pack`` itself keeps float32)."""
    batch = pack(samples)
    batch.advantages = torch.tensor(rewards, dtype=torch.float64)
    batch.values = torch.zeros(batch.loss_mask.shape, dtype=torch.float64)
    for i, row in enumerate(values):
        batch.values[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
    return batch


def miles_gae(reward: float, values: list[float], mask: list[int], gamma: float, lambd: float,
              token_rewards: list[float] | None = None) -> tuple[list[float], list[float]]:
    """miles' per-sample GAE in plain floats: the sample compressed to its trained tokens, the reward
    at the last of them, V after it 0; 0 at the untrained tokens (a sample without any: all 0)."""
    trained = [t for t, m in enumerate(mask) if m]
    rewards = [(token_rewards or [0.0] * len(values))[t] for t in trained]
    if trained:
        rewards[-1] += reward
    packed, running = [0.0] * len(trained), 0.0
    for k in reversed(range(len(trained))):
        next_value = values[trained[k + 1]] if k + 1 < len(trained) else 0.0
        delta = rewards[k] + gamma * next_value - values[trained[k]]
        running = delta + gamma * lambd * running
        packed[k] = running
    advantages, returns = [0.0] * len(values), [0.0] * len(values)
    for k, t in enumerate(trained):
        advantages[t], returns[t] = packed[k], packed[k] + values[t]
    return advantages, returns


def old_miles_gae(reward: float, values: list[float], gamma: float, lambd: float) -> tuple[list[float], list[float]]:
    """miles before #1827: every response token, the reward at the last response token."""
    advantages, running = [0.0] * len(values), 0.0
    for t in reversed(range(len(values))):
        next_value = values[t + 1] if t < len(values) - 1 else 0.0
        delta = (reward if t == len(values) - 1 else 0.0) + gamma * next_value - values[t]
        running = delta + gamma * lambd * running
        advantages[t] = running
    return advantages, [a + v for a, v in zip(advantages, values)]


def miles_value_loss(new, old, returns, masks, clip: float, per_token: bool) -> tuple[float, float]:
    """miles' value loss and clip fraction in sum form (``sum_of_sample_mean`` before the division)."""
    loss_total = clip_total = 0.0
    for v, o, r, m in zip(new, old, returns, masks):
        losses, clipped = [], []
        for vv, oo, rr in zip(v, o, r):
            clipped_value = oo + min(max(vv - oo, -clip), clip)
            losses.append(max((clipped_value - rr) ** 2, (vv - rr) ** 2))
            clipped.append(1.0 if abs(vv - oo) > clip else 0.0)
        count = 1.0 if per_token else max(sum(m), 1)
        loss_total += sum(x * mm for x, mm in zip(losses, m)) / count
        clip_total += sum(x * mm for x, mm in zip(clipped, m)) / count
    return loss_total, clip_total


def rows(tensor: torch.Tensor, masks=MASKS) -> list[list[float]]:
    return [tensor[i, :len(m)].tolist() for i, m in enumerate(masks)]


@pytest.mark.parametrize("gamma,lambd", SETTINGS)
def test_gae_matches_miles_per_sample(gamma, lambd) -> None:
    samples, rewards, values = scored()
    advantages, returns = ppo_advantages_and_returns(as_batch(samples, rewards, values), as_batch(
        samples, rewards, values).values, gamma, lambd)
    assert advantages.dtype == torch.float64
    for i, (reward, row) in enumerate(zip(rewards, values)):
        expected_adv, expected_ret = miles_gae(reward, row, MASKS[i], gamma, lambd)
        assert rows(advantages)[i] == pytest.approx(expected_adv, abs=1e-9)
        assert rows(returns)[i] == pytest.approx(expected_ret, abs=1e-9)
    padding = as_batch(samples, rewards, values).response_mask == 0
    assert advantages[padding].abs().max() == 0 and returns[padding].abs().max() == 0  # right padding is exact


def test_gae_by_hand() -> None:
    """One sample, rewards [0, 0, 1], values [0.5, 0.2, 0.4], gamma 0.9, lambd 0.5."""
    advantages, returns = gae(torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64),
                              torch.tensor([[0.5, 0.2, 0.4]], dtype=torch.float64), 0.9, 0.5)
    d2 = 1.0 - 0.4
    d1 = 0.9 * 0.4 - 0.2
    d0 = 0.9 * 0.2 - 0.5
    a2, a1 = d2, d1 + 0.45 * d2
    assert advantages[0].tolist() == pytest.approx([d0 + 0.45 * a1, a1, a2], abs=1e-12)
    assert returns[0].tolist() == pytest.approx([d0 + 0.45 * a1 + 0.5, a1 + 0.2, a2 + 0.4], abs=1e-12)


def test_gae_over_a_ragged_mask_by_hand() -> None:
    """Mask [1, 1, 0, 0, 1, 1, 0] (tool output at 2-3, an untrained last token), reward 1.0, gamma 0.9,
    lambd 0.5 (gamma * lambd = 0.45), values [0.5, 0.2, 0.7, -0.3, 0.4, 0.1, 0.9]. The trained tokens
    0, 1, 4, 5 carry values 0.5, 0.2, 0.4, 0.1; the reward sits on token 5, the last trained one:
      t=5: delta = 1 - 0.1 = 0.9                      A = 0.9                          R = 1.0
      t=4: delta = 0.9 * 0.1 - 0.4 = -0.31            A = -0.31 + 0.45 * 0.9 = 0.095    R = 0.495
      t=1: delta = 0.9 * 0.4 - 0.2 = 0.16 (V_4 boots) A = 0.16 + 0.45 * 0.095 = 0.20275 R = 0.40275
      t=0: delta = 0.9 * 0.2 - 0.5 = -0.32            A = -0.32 + 0.45 * 0.20275 = -0.2287625
                                                                                        R = 0.2712375
    and 0 at tokens 2, 3 and 6."""
    sample = Sample(prompt_ids=[1], response_ids=[4] * 7, loss_mask=[1, 1, 0, 0, 1, 1, 0], advantage=1.0)
    batch = as_batch([sample], [1.0], [[0.5, 0.2, 0.7, -0.3, 0.4, 0.1, 0.9]])
    advantages, returns = ppo_advantages_and_returns(batch, batch.values, 0.9, 0.5)
    assert advantages[0].tolist() == pytest.approx([-0.2287625, 0.20275, 0.0, 0.0, 0.095, 0.9, 0.0], abs=1e-12)
    assert returns[0].tolist() == pytest.approx([0.2712375, 0.40275, 0.0, 0.0, 0.495, 1.0, 0.0], abs=1e-12)


def test_ppo_kl_shapes_the_trained_tokens_rewards_by_hand() -> None:
    """``--kl-coef 0.5`` (k1: old - ref = [0.2, 5.0, 0.4]), mask [1, 0, 1], values [0.5, 9.0, 0.2],
    reward 1.0, gamma 0.9, lambd 0.5: rewards -0.1 on token 0, -0.2 + 1 = 0.8 on token 2 (token 1's
    KL is dropped). t=2: A = 0.8 - 0.2 = 0.6; t=0: delta = -0.1 + 0.9 * 0.2 - 0.5 = -0.42,
    A = -0.42 + 0.45 * 0.6 = -0.15; returns -0.15 + 0.5 = 0.35 and 0.6 + 0.2 = 0.8."""
    sample = Sample(prompt_ids=[1], response_ids=[4] * 3, loss_mask=[1, 0, 1], advantage=1.0)
    batch = as_batch([sample], [1.0], [[0.5, 9.0, 0.2]])
    config = TrainConfig(advantage_estimator="ppo", kl_coef=0.5, gamma=0.9, lambd=0.5)
    old = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    ref = old - torch.tensor([[0.2, 5.0, 0.4]], dtype=torch.float64)
    advantages, returns = token_advantages_and_returns(config, batch, old, ref)
    assert advantages[0].tolist() == pytest.approx([-0.15, 0.0, 0.6], abs=1e-12)
    assert returns[0].tolist() == pytest.approx([0.35, 0.0, 0.8], abs=1e-12)
    with pytest.raises(ValueError, match="--kl-coef needs the reference"):
        token_advantages_and_returns(config, batch, old, None)


@pytest.mark.parametrize("gamma,lambd", SETTINGS)
def test_an_all_ones_mask_gives_the_recursion_over_every_token(gamma, lambd) -> None:
    """With every response token trained, GAE is miles' before #1827 (the reward on the last token)."""
    samples, rewards, values = scored()
    full = [Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, advantage=s.advantage) for s in samples]
    batch = as_batch(full, rewards, values)
    advantages, returns = ppo_advantages_and_returns(batch, batch.values, gamma, lambd)
    all_ones = [[1] * len(m) for m in MASKS]
    for i, (reward, row) in enumerate(zip(rewards, values)):
        expected_adv, expected_ret = old_miles_gae(reward, row, gamma, lambd)
        assert rows(advantages, all_ones)[i] == pytest.approx(expected_adv, abs=1e-9)
        assert rows(returns, all_ones)[i] == pytest.approx(expected_ret, abs=1e-9)


@pytest.mark.parametrize("normalize", [False, True])
def test_the_policy_takes_the_gae_advantages(normalize) -> None:
    """``--advantage-estimator ppo``: the policy's per-token advantages are GAE's over the packed
    critic values (whitened over the trained tokens with --normalize-advantages, as miles)."""
    samples, rewards, values = scored()
    batch = as_batch(samples, rewards, values)
    config = TrainConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.95, normalize_advantages=normalize)
    [advantages] = rollout_advantages(config, [batch], [None], [None], device="cpu")
    expected = [miles_gae(r, v, m, 0.9, 0.95)[0] for r, v, m in zip(rewards, values, MASKS)]
    if normalize:
        trained = [a for row, m in zip(expected, MASKS) for a, mm in zip(row, m) if mm]
        mean = sum(trained) / len(trained)
        var = sum((a - mean) ** 2 for a in trained) / (len(trained) - 1)
        expected = [[(a - mean) / math.sqrt(var + 1e-8) for a in row] for row in expected]
    for got, want, mask in zip(rows(advantages), expected, MASKS):
        assert [g for g, m in zip(got, mask) if m] == pytest.approx([w for w, m in zip(want, mask) if m], abs=1e-6)


@pytest.mark.parametrize("per_token", [False, True])
@pytest.mark.parametrize("clip", [0.2, 0.05, 10.0])
def test_value_loss_matches_miles(per_token, clip) -> None:
    samples, rewards, old = scored()
    batch = as_batch(samples, rewards, old)
    returns = ppo_advantages_and_returns(batch, batch.values, 0.95, 0.9)[1]
    generator = torch.Generator().manual_seed(1)
    new = batch.values + 0.2 * torch.randn(batch.values.shape, generator=generator, dtype=torch.float64)
    loss, clipped = clipped_value_loss(new, batch.values, returns, clip)
    got_loss = masked_sum(loss, batch.loss_mask, per_token=per_token).item()
    got_clip = masked_sum(clipped, batch.loss_mask, per_token=per_token).item()
    want_loss, want_clip = miles_value_loss(rows(new), rows(batch.values), rows(returns), MASKS, clip, per_token)
    assert got_loss == pytest.approx(want_loss, abs=1e-9)
    assert got_clip == pytest.approx(want_clip, abs=1e-9)
    if clip < 1:
        assert 0 < got_clip  # some tokens moved past the clip


def test_the_value_loss_gradient_is_the_clipped_one() -> None:
    """Where the clipped branch binds and the value moved past the clip, the token gets no gradient;
    elsewhere d/dV (V - R)^2 = 2 (V - R)."""
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0, -1.0]], dtype=torch.float64)
    new = torch.tensor([[0.1, 0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    loss, clipped = clipped_value_loss(new, old, returns, 0.2)
    loss.sum().backward()
    # token 0: inside the clip, 2(V - R); token 1: moved 0.5 toward R, the clipped error (0.8^2) binds,
    # constant in V; token 2: moved away from R, the unclipped error binds
    assert new.grad[0].tolist() == pytest.approx([2 * (0.1 - 1.0), 0.0, 2 * (0.5 + 1.0)], abs=1e-12)
    assert clipped[0].tolist() == [0.0, 1.0, 1.0]
    assert torch.autograd.gradcheck(lambda v: clipped_value_loss(v, old, returns, 0.2)[0].sum(),
                                    (torch.tensor([[0.1, 0.05, -0.3]], dtype=torch.float64, requires_grad=True),))


@pytest.mark.parametrize("per_token", [False, True])
def test_two_ranks_reduce_to_one(per_token) -> None:
    """The critic's step loss: each rank's sum over its share, summed over ranks and divided by the
    global count (``step_denominators``), equals one rank's over the whole batch; so does the gradient."""
    samples, rewards, old = scored()
    generator = torch.Generator().manual_seed(2)
    shift = [(0.3 * torch.randn(len(m), generator=generator, dtype=torch.float64)).tolist() for m in MASKS]

    def step_loss(indices_per_rank):
        shares = [[samples[i] for i in idx] for idx in indices_per_rank]
        batches = [as_batch(share, [rewards[i] for i in idx], [old[i] for i in idx])
                   for share, idx in zip(shares, indices_per_rank)]
        denominator = sum(step_denominators([[b]], per_token=per_token)[0] for b in batches)
        total, grads = 0.0, []
        for b, idx in zip(batches, indices_per_rank):
            returns = ppo_advantages_and_returns(b, b.values, 0.9, 0.8)[1]
            new = (b.values + as_batch([samples[i] for i in idx], [rewards[i] for i in idx],
                                       [shift[i] for i in idx]).values).requires_grad_(True)
            loss = masked_sum(clipped_value_loss(new, b.values, returns, 0.2)[0], b.loss_mask, per_token=per_token)
            (loss / denominator).backward()
            total += loss.item()
            grads += rows(new.grad, [MASKS[i] for i in idx])
        order = [i for idx in indices_per_rank for i in idx]
        return total / denominator, [g for _, g in sorted(zip(order, grads))]

    one_loss, one_grads = step_loss([list(range(len(MASKS)))])
    two_loss, two_grads = step_loss([[0, 2, 4], [1, 3]])
    assert two_loss == pytest.approx(one_loss, abs=1e-12)
    for a, b in zip(one_grads, two_grads):
        assert a == pytest.approx(b, abs=1e-12)


def test_explained_variance_over_the_trained_tokens_and_ranks() -> None:
    samples, rewards, values = scored()
    batch = as_batch(samples, rewards, values)
    returns = ppo_advantages_and_returns(batch, batch.values, 1.0, 1.0)[1]
    trained = batch.loss_mask.bool()
    r, v = returns[trained], batch.values[trained]
    expected = 1 - torch.var(r - v, unbiased=False).item() / torch.var(r, unbiased=False).item()
    one = explained_variance(explained_variance_sums(batch.values, returns, batch.loss_mask))
    halves = [explained_variance_sums(batch.values[s], returns[s], batch.loss_mask[s]) for s in (slice(0, 2), slice(2, 5))]
    two = explained_variance([a + b for a, b in zip(*halves)])
    assert one == pytest.approx(expected, abs=1e-9) and two == pytest.approx(expected, abs=1e-9)
    assert explained_variance(explained_variance_sums(returns, returns, batch.loss_mask)) == pytest.approx(1.0)


def test_ppo_takes_the_raw_reward_and_the_samples_carry_the_critic_values() -> None:
    groups = [Group(prompt_index=0, samples=[Sample(response_ids=[1, 2], reward=r) for r in (0.2, 0.9, 0.4)])]
    samples = assign_advantages(groups, TrainConfig(advantage_estimator="ppo"))
    assert [s.advantage for s in samples] == pytest.approx([0.2, 0.9, 0.4])  # no group normalization (miles)
    assert pack(samples).values is None
    for s in samples:
        attach_values(s, [0.5, -0.25])
    assert values_of(samples[0]) == [0.5, -0.25]
    assert pack(samples).values.tolist() == [[0.5, -0.25]] * 3
    with pytest.raises(ValueError, match="3 critic values for a response of 2 tokens"):
        attach_values(samples[0], [0.0] * 3)


def test_a_critic_only_step_records_the_critic_alone() -> None:
    critic = TrainResult(steps=[{"critic/value_loss": 1.0}, {"critic/value_loss": 0.5}],
                         rollout={"critic/explained_variance": 0.1})
    alone = merge_results(None, critic)
    assert alone.steps == [{"critic/value_loss": 1.0, "critic/actor_trained": 0.0},
                           {"critic/value_loss": 0.5, "critic/actor_trained": 0.0}]
    actor = TrainResult(steps=[{"train/loss": 2.0}, {"train/loss": 1.0}], rollout={"train/x": 3.0})
    both = merge_results(actor, critic)
    assert both.steps[1] == {"train/loss": 1.0, "critic/value_loss": 0.5, "critic/actor_trained": 1.0}
    assert both.rollout == {"train/x": 3.0, "critic/explained_variance": 0.1}
    with pytest.raises(ValueError, match="1 optimizer steps and the critic 2"):
        merge_results(TrainResult(steps=[{}]), critic)
