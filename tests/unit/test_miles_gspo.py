"""``--advantage-estimator gspo`` (and OPSM, TIS, skip-forward with it) against an independent
float64 implementation of miles' formulas in plain Python floats: the sequence-level ratio is
``exp`` of each sample's mean of ``new - old`` over its trained tokens (the geometric mean of its
token ratios), clipped as a whole; TIS weights stay per token; per-sample and per-token
aggregation; the gradient by finite differences; and a batch split over two "ranks" (sum form
over the global denominator) gives exactly what one gives."""

from __future__ import annotations

import math

import pytest
import torch

from miles_disagg.config import load_config
from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.policy_gradient import rl_loss
from miles_disagg.trainer.sequence_advantages import assign_advantages
from miles_disagg.samples import Group, Sample

MASKS = [[1, 1, 0, 1, 1], [1, 1, 1], [0, 0], [1, 0, 1, 1]]


def data(seed: int = 0):
    """Ragged samples (a tool token, a sample without trained tokens) and float64 logprobs."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for i, mask in enumerate(MASKS):
        rollout = (-torch.rand(len(mask), generator=generator, dtype=torch.float64) * 2).tolist()
        samples.append(Sample(prompt_ids=[1, 2], response_ids=[3] * len(mask), response_logprobs=rollout,
                              loss_mask=mask, advantage=(1.5, -0.8, 0.4, -2.0)[i]))
    batch = pack(samples)
    shape = batch.loss_mask.shape
    old = -torch.rand(shape, generator=generator, dtype=torch.float64) * 2
    logprobs = old + 0.25 * torch.randn(shape, generator=generator, dtype=torch.float64)
    return samples, batch, logprobs, old


def token_advantages(batch) -> torch.Tensor:
    return batch.advantages.double().unsqueeze(-1) * batch.response_mask.double()


def miles_gspo(logprobs, old, rollout, adv, masks, *, eps=0.2, eps_high=0.28, tis=None, per_token=False) -> float:
    """miles' policy loss with the GSPO ratio, in plain floats (the sum form the backend divides)."""
    total = 0.0
    for lp, o, r, a, m in zip(logprobs, old, rollout, adv, masks):
        n = sum(m)
        sequence_kl = sum((oo - ll) * mm for ll, oo, mm in zip(lp, o, m)) / max(n, 1)
        ratio = math.exp(max(-20.0, min(20.0, -sequence_kl)))
        loss = max(-ratio * a, -min(max(ratio, 1 - eps), 1 + eps_high) * a)
        tokens = [loss * (min(max(math.exp(oo - rr), tis[0]), tis[1]) if tis else 1.0) * mm
                  for oo, rr, mm in zip(o, r, m)]
        total += sum(tokens) if per_token else sum(tokens) / max(n, 1)
    return total


def rows(values: torch.Tensor, masks=MASKS) -> list[list[float]]:
    return [values[i, :len(m)].tolist() for i, m in enumerate(masks)]


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("tis", [None, (0.5, 1.5)], ids=["plain", "tis"])
def test_gspo_loss_and_gradient_match_miles(per_token, tis) -> None:
    _, batch, logprobs, old = data()
    config = TrainConfig(advantage_estimator="gspo", eps_clip=0.2, eps_clip_high=0.28, calculate_per_token_loss=per_token,
                         use_tis=tis is not None, tis_clip_low=tis[0] if tis else 0.0, tis_clip=tis[1] if tis else 2.0)
    lp = logprobs.clone().requires_grad_()
    loss, metrics = rl_loss(config, batch, lp, None, old, None, token_advantages(batch), torch.device("cpu"))
    loss.backward()
    masks, rollout = [[float(v) for v in m] for m in MASKS], rows(batch.rollout_logprobs.double())
    adv = batch.advantages.tolist()

    def expected(values: list[list[float]]) -> float:
        return miles_gspo(values, rows(old), rollout, adv, masks, tis=tis, per_token=per_token)

    assert loss.item() == pytest.approx(expected(rows(logprobs)), abs=1e-9)
    assert metrics["train/pg_loss"] == pytest.approx(loss.item(), abs=1e-12)
    h = 1e-6
    for i, m in enumerate(MASKS):
        for t in range(len(m)):
            up, down = rows(logprobs), rows(logprobs)
            up[i][t] += h
            down[i][t] -= h
            assert lp.grad[i, t].item() == pytest.approx((expected(up) - expected(down)) / (2 * h), abs=1e-6)
    assert lp.grad[2].abs().sum() == 0 and lp.grad[0, 2] == 0  # no trained token, a tool token: no gradient


def test_gspo_clips_the_sequence_ratio_and_reports_the_sequence_kl() -> None:
    _, batch, logprobs, old = data(1)
    config = TrainConfig(advantage_estimator="gspo", eps_clip=0.05)
    _, metrics = rl_loss(config, batch, logprobs, None, old, None, token_advantages(batch), torch.device("cpu"))
    clipped = ppo_kl = 0.0
    for lp, o, a, m in zip(rows(logprobs), rows(old), batch.advantages.tolist(), MASKS):
        n = sum(m)
        kl = sum((oo - ll) * mm for ll, oo, mm in zip(lp, o, m)) / max(n, 1)
        ratio = math.exp(-kl)
        clipped += float(-min(max(ratio, 0.95), 1.05) * a > -ratio * a) if n else 0.0
        ppo_kl += kl if n else 0.0
    assert metrics["train/pg_clipfrac"] == pytest.approx(clipped, abs=1e-9)
    assert 0 < clipped < 3  # some sequences clip, not all
    assert metrics["train/ppo_kl"] == pytest.approx(ppo_kl, abs=1e-9)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("estimator", ["grpo", "gspo"])
def test_two_ranks_give_what_one_gives(per_token, estimator) -> None:
    """Each rank's sum form over the global denominator adds up to the whole batch's (loss, gradient)."""
    samples, _, logprobs, old = data(2)
    config = TrainConfig(advantage_estimator=estimator, calculate_per_token_loss=per_token, use_tis=True,
                         use_opsm=True, opsm_delta=0.01)

    def rank_loss(indices: list[int]):
        batch = pack([samples[i] for i in indices])
        width = batch.loss_mask.shape[1]
        lp = logprobs[indices, :width].clone().requires_grad_()
        loss, _ = rl_loss(config, batch, lp, None, old[indices, :width], None, token_advantages(batch),
                          torch.device("cpu"))
        denominator = pack(samples).num_tokens if per_token else len(samples)  # the step's global count
        (loss / denominator).backward()
        return loss.item() / denominator, lp.grad

    whole, whole_grad = rank_loss([0, 1, 2, 3])
    (first, first_grad), (second, second_grad) = rank_loss([0, 2]), rank_loss([1, 3])
    assert first + second == pytest.approx(whole, abs=1e-12)
    assert torch.allclose(first_grad[0], whole_grad[0, :first_grad.shape[1]], atol=1e-12)
    assert torch.allclose(second_grad[1], whole_grad[3, :second_grad.shape[1]], atol=1e-12)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_opsm_drops_negative_advantage_sequences_that_moved_too_far(per_token) -> None:
    _, batch, logprobs, old = data(3)
    config = TrainConfig(use_opsm=True, opsm_delta=0.05, calculate_per_token_loss=per_token)
    _, metrics = rl_loss(config, batch, logprobs, None, old, None, token_advantages(batch), torch.device("cpu"))
    expected_pg = expected_clipfrac = 0.0
    for lp, o, a, m in zip(rows(logprobs), rows(old), batch.advantages.tolist(), MASKS):
        n = sum(m)
        kl = sum((oo - ll) * mm for ll, oo, mm in zip(lp, o, m)) / max(n, 1)
        drop = a < 0 and kl > 0.05
        expected_clipfrac += (len(m) if drop else 0) / max(n, 1)
        tokens = [0.0 if drop else max(-math.exp(ll - oo) * a, -min(max(math.exp(ll - oo), 0.8), 1.2) * a) * mm
                  for ll, oo, mm in zip(lp, o, m)]
        expected_pg += sum(tokens) if per_token else sum(tokens) / max(n, 1)
    assert expected_clipfrac > 0  # some sequence is dropped
    assert metrics["train/opsm_clipfrac"] == pytest.approx(expected_clipfrac, abs=1e-9)
    assert metrics["train/pg_loss"] == pytest.approx(expected_pg, abs=1e-9)


def test_skipping_the_forward_only_pass_makes_the_ratio_exactly_one() -> None:
    _, batch, logprobs, _ = data(4)
    config = TrainConfig(advantage_estimator="gspo", skip_actor_forward_only=True)
    lp = logprobs.clone().requires_grad_()
    loss, metrics = rl_loss(config, batch, lp, None, None, None, token_advantages(batch), torch.device("cpu"))
    adv = batch.advantages.tolist()
    assert loss.item() == pytest.approx(sum(-a for a, m in zip(adv, MASKS) if sum(m)), abs=1e-12)
    assert metrics["train/ppo_kl"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
    diff = sum(sum(abs(l - r) * m for l, r, m in zip(*t)) / max(sum(t[2]), 1)
               for t in zip(rows(logprobs), rows(batch.rollout_logprobs.double()), MASKS))
    assert metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(diff, abs=1e-6)


def test_gspo_advantages_are_grpo_advantages_and_a_miles_gspo_line_loads() -> None:
    groups = [Group(prompt_index=0, samples=[Sample(prompt_ids=[1], response_ids=[2], reward=r) for r in (1.0, 0.0, 0.5)])]
    gspo = [s.advantage for s in assign_advantages(groups, TrainConfig(advantage_estimator="gspo"))]
    grpo = [s.advantage for s in assign_advantages(groups, TrainConfig(advantage_estimator="grpo"))]
    assert gspo == grpo and gspo[0] > 0 > gspo[1]
    config, _ = load_config(["--advantage-estimator", "gspo", "--eps-clip", "4e-4", "--eps-clip-high", "3e-4",
                             "--use-tis", "--use-kl-loss"], "train_async")
    assert (config.train.advantage_estimator, config.train.eps_clip, config.train.kl_loss_type) == ("gspo", 4e-4, "k1")
