"""miles' loss extension points: ``--loss-type custom_loss`` with ``--custom-loss-function-path``,
``--loss-type sft_loss``, ``--custom-tis-function-path``, ``--custom-pg-loss-reducer-function-path``.

Hooks are the modules of ``miles_loss_examples.py``, written as miles' examples write them (miles'
import paths, signatures and layout), loaded by dotted path; each result is checked against an
independent float64 implementation of miles' formula (plain Python floats), per sample and per token."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from miles_disagg.config import load_config
from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.batches import pack, response_logits
from miles_disagg.trainer.losses import token_logprobs_and_entropy
from miles_disagg.trainer.objective import TrainObjective
from miles_disagg.trainer.rollout_inputs import prepare_rollout
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

HOOKS = "miles_loss_examples"
VOCAB, TEMPERATURE = 11, 0.7


def batch_and_logits(seed: int = 0):
    """Three ragged samples (one with a tool token, one with no trained token) and float64 logits."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, [1, 0, 1, 1]), (3, 2, [1, 1]), (1, 3, [0, 0, 0])]
    samples = []
    for prompt, length, mask in shapes:
        ids = torch.randint(1, VOCAB, (prompt + length,), generator=generator).tolist()
        rollout = (-torch.rand(length, generator=generator, dtype=torch.float64) * 2).tolist()
        samples.append(Sample(prompt_ids=ids[:prompt], response_ids=ids[prompt:], response_logprobs=rollout,
                              loss_mask=mask, advantage=float(torch.randn((), generator=generator))))
    batch = pack(samples)
    logits = torch.randn(*batch.input_ids.shape, VOCAB, generator=generator, dtype=torch.float64)
    return batch, logits.requires_grad_()


def frozen_inputs(config: TrainConfig, batch, logits):
    """What the backend computes before the steps: recomputed (old) logprobs, a reference, advantages."""
    with torch.no_grad():
        old = token_logprobs_and_entropy(response_logits(logits, batch) / TEMPERATURE, batch.response_ids, False)[0]
    generator = torch.Generator().manual_seed(1)
    old = old + 0.3 * torch.randn(old.shape, generator=generator, dtype=torch.float64)  # a later step's policy
    ref = old - 0.2 * torch.rand(old.shape, generator=generator, dtype=torch.float64)
    return prepare_rollout(config, [[batch]], [old], [ref]).micro[0]


def run(config: TrainConfig, batch, logits):
    """(loss, metrics, d loss / d logits) of one micro-batch through the objective, as a backend runs it."""
    logits = logits.detach().clone().requires_grad_()
    objective = TrainObjective(config, TEMPERATURE)
    logprobs, entropy = token_logprobs_and_entropy(response_logits(logits, batch) / TEMPERATURE,
                                                   batch.response_ids, True)
    frozen = frozen_inputs(config, batch, logits)
    loss, metrics = objective(batch, frozen, logprobs, entropy, logits, torch.device("cpu"))
    loss.backward()
    return loss.detach(), metrics, logits.grad, frozen


def rows(batch, values) -> list[list[float]]:
    lengths = batch.response_mask.sum(-1).long().tolist()
    return [values[i, :n].tolist() for i, n in enumerate(lengths)]


def masks(batch) -> list[list[float]]:
    return rows(batch, batch.loss_mask)


def reduce(values: list[list[float]], mask: list[list[float]], per_token: bool, denominators=None) -> float:
    """miles' sum_of_sample_mean (no CP), in plain floats."""
    total = 0.0
    for i, (row, m) in enumerate(zip(values, mask)):
        s = sum(v * w for v, w in zip(row, m))
        count = sum(denominators[i] if denominators is not None else m)
        total += s if per_token else s / max(count, 1.0)
    return total


def current_logprobs(batch, logits) -> list[list[float]]:
    with torch.no_grad():
        lp = token_logprobs_and_entropy(response_logits(logits, batch) / TEMPERATURE, batch.response_ids, False)[0]
    return rows(batch, lp)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("extra", [{}, {"advantage_estimator": "gspo", "use_tis": True, "use_kl_loss": True,
                                        "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "entropy_coef": 0.01}],
                         ids=["grpo", "gspo-tis-kl"])
def test_miles_policy_loss_function_as_a_custom_loss_trains_exactly_as_the_built_in_loss(per_token, extra) -> None:
    batch, logits = batch_and_logits()
    built_in = TrainConfig(calculate_per_token_loss=per_token, eps_clip_high=0.28, **extra)
    custom = dataclasses.replace(built_in, loss_type="custom_loss",
                                 custom_loss_function_path=f"{HOOKS}.plain_policy_loss")
    loss, metrics, grad, _ = run(built_in, batch, logits)
    custom_loss, custom_metrics, custom_grad, _ = run(custom, batch, logits)
    assert custom_loss.item() == pytest.approx(loss.item(), abs=1e-12)
    assert torch.allclose(custom_grad, grad, atol=1e-12, rtol=0)
    assert grad.abs().sum() > 0
    for key in ("train/pg_loss", "train/ppo_kl", "train/pg_clipfrac"):
        assert custom_metrics[key] == pytest.approx(metrics[key], abs=1e-12)
    assert custom_metrics["train/entropy_loss"] == pytest.approx(metrics["train/entropy"], abs=1e-12)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_reinforce_icepop_custom_loss_matches_miles_formula(per_token) -> None:
    config = TrainConfig(loss_type="custom_loss", custom_loss_function_path=f"{HOOKS}.reinforce_icepop_loss",
                         calculate_per_token_loss=per_token, eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.0)
    batch, logits = batch_and_logits(3)
    loss, metrics, _, frozen = run(config, batch, logits)
    lp, rollout, adv = current_logprobs(batch, logits), rows(batch, batch.rollout_logprobs), rows(batch, frozen.advantages)
    per = [[-(math.exp(l - r) if 0.8 < math.exp(l - r) < 1.28 else 0.0) * a * l for l, r, a in zip(*t)]
           for t in zip(lp, rollout, adv)]
    assert loss.item() == pytest.approx(reduce(per, masks(batch), per_token), abs=1e-9)
    outside = [[0.0 if 0.8 < math.exp(l - r) < 1.28 else 1.0 for l, r in zip(*t)] for t in zip(lp, rollout)]
    assert metrics["train/mask_frac"] == pytest.approx(reduce(outside, masks(batch), per_token), abs=1e-9)


def miles_pg(ppo_kl: float, adv: float, eps: float = 0.2, eps_high: float = 0.2) -> float:
    ratio = math.exp(max(-20.0, min(20.0, -ppo_kl)))
    return max(-ratio * adv, -min(max(ratio, 1 - eps), 1 + eps_high) * adv)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_dr_grpo_reducer_divides_the_policy_term_by_a_constant(per_token) -> None:
    config = TrainConfig(custom_pg_loss_reducer_function_path=f"{HOOKS}.get_pg_loss_reducer",
                         calculate_per_token_loss=per_token)
    batch, logits = batch_and_logits(5)
    _, metrics, _, frozen = run(config, batch, logits)
    lp, old, adv = current_logprobs(batch, logits), rows(batch, frozen.old), rows(batch, frozen.advantages)
    per = [[miles_pg(o - l, a) for l, o, a in zip(*t)] for t in zip(lp, old, adv)]
    expected = reduce(per, masks(batch), True) / (1.0 if per_token else 1000.0)
    assert metrics["train/pg_loss"] == pytest.approx(expected, abs=1e-9)
    clipfrac = [[float(miles_pg(o - l, a) != -math.exp(l - o) * a) for l, o, a in zip(*t)] for t in zip(lp, old, adv)]
    assert metrics["train/pg_clipfrac"] == pytest.approx(reduce(clipfrac, masks(batch), per_token), abs=1e-9)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("flags", [{"use_tis": True}, {"get_mismatch_metrics": True}], ids=["tis", "mismatch"])
def test_custom_tis_weights_and_rejects_keeping_miles_denominators(per_token, flags) -> None:
    config = TrainConfig(custom_tis_function_path=f"{HOOKS}.truncate_and_mask", calculate_per_token_loss=per_token,
                         **flags)
    batch, logits = batch_and_logits(7)
    loss, metrics, _, frozen = run(config, batch, logits)
    lp, old, adv = current_logprobs(batch, logits), rows(batch, frozen.old), rows(batch, frozen.advantages)
    rollout, mask = rows(batch, batch.rollout_logprobs), masks(batch)
    ratio = [[math.exp(o - r) for o, r in zip(*t)] for t in zip(old, rollout)]
    per = [[miles_pg(o - l, a) * min(w, 2.0) for l, o, a, w in zip(*t)] for t in zip(lp, old, adv, ratio)]
    kept = [[m * (w >= 0.5) for m, w in zip(*t)] for t in zip(mask, ratio)]
    assert any(sum(k) < sum(m) for k, m in zip(kept, mask))  # the function rejects some trained token
    assert metrics["train/pg_loss"] == pytest.approx(reduce(per, kept, per_token, denominators=mask), abs=1e-9)
    assert loss.item() == pytest.approx(metrics["train/pg_loss"], abs=1e-12)
    rejected = [[float(w < 0.5) for w in row] for row in ratio]
    assert metrics["train/rejected_fraction"] == pytest.approx(reduce(rejected, mask, per_token), abs=1e-9)
    ois = [[math.exp(l - o) for l, o in zip(*t)] for t in zip(lp, old)]
    assert metrics["train/ois"] == pytest.approx(reduce(ois, mask, per_token), abs=1e-9)


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_sft_loss_is_minus_the_mean_logprob_of_trained_tokens(per_token) -> None:
    config = TrainConfig(loss_type="sft_loss", disable_compute_advantages_and_returns=True,
                         calculate_per_token_loss=per_token)
    batch, logits = batch_and_logits(9)
    loss, metrics, _, frozen = run(config, batch, logits)
    assert frozen.advantages is None
    assert loss.item() == pytest.approx(-reduce(current_logprobs(batch, logits), masks(batch), per_token), abs=1e-9)
    assert metrics == {"train/loss": pytest.approx(loss.item())}


def test_a_custom_loss_adding_a_term_to_miles_policy_loss() -> None:
    config = TrainConfig(loss_type="custom_loss", custom_loss_function_path=f"{HOOKS}.policy_plus_kl_to_rollout")
    batch, logits = batch_and_logits(11)
    loss, metrics, _, _ = run(config, batch, logits)
    base, _, _, _ = run(TrainConfig(), batch, logits)
    lp, rollout = current_logprobs(batch, logits), rows(batch, batch.rollout_logprobs)
    k3 = [[math.exp(r - l) - 1 - (r - l) for l, r in zip(*t)] for t in zip(lp, rollout)]
    penalty = reduce(k3, masks(batch), False)
    assert metrics["train/rollout_kl"] == pytest.approx(penalty, abs=1e-9)
    assert loss.item() == pytest.approx(base.item() + 0.5 * penalty, abs=1e-9)


@pytest.mark.parametrize("flags, message", [
    ({"custom_pg_loss_reducer_function_path": f"{HOOKS}.not_a_reducer"},
     "--custom-pg-loss-reducer-function-path 'miles_loss_examples.not_a_reducer' has signature"),
    ({"loss_type": "custom_loss", "custom_loss_function_path": f"{HOOKS}.async_loss"},
     "--custom-loss-function-path 'miles_loss_examples.async_loss' must be a plain"),
    ({"loss_type": "custom_loss", "custom_loss_function_path": f"{HOOKS}.no_such_loss"},
     "has no attribute 'no_such_loss'"),
    ({"use_tis": True, "custom_tis_function_path": "no_such_module.tis"}, "cannot import module 'no_such_module'"),
])
def test_a_wrong_hook_fails_at_load_with_one_line(flags, message) -> None:
    with pytest.raises(ConfigError) as info:
        TrainObjective(TrainConfig(**flags))
    assert message in str(info.value) and "\n" not in str(info.value)


def test_served_miles_paths_and_what_is_not_served() -> None:
    from miles_disagg.trainer.miles_loss_api import serve_miles_loss_modules

    serve_miles_loss_modules()
    from miles.backends.training_utils.loss_hub.math_utils import compute_policy_loss
    from miles.utils.types import RolloutBatch

    loss, clipped = compute_policy_loss(torch.tensor([-25.0]), torch.tensor([-1.0]), 0.2, 0.28)
    assert loss.item() == pytest.approx(math.exp(20.0), rel=1e-6) and clipped.item() == 0.0
    assert RolloutBatch is dict
    with pytest.raises(ModuleNotFoundError, match="miles.backends.fsdp_utils is a miles module"):
        import miles.backends.fsdp_utils  # noqa: F401
    import miles.utils.ppo_utils as ppo

    with pytest.raises(AttributeError, match="miles.utils.ppo_utils.get_grpo_returns is a miles name"):
        ppo.get_grpo_returns  # noqa: B018


@pytest.mark.parametrize("argv, message", [
    (["--loss-type", "custom_loss"], "--loss-type custom_loss needs --custom-loss-function-path"),
    (["--custom-loss-function-path", "a.b"], "is the loss only with --loss-type custom_loss"),
    (["--get-mismatch-metrics"], "--get-mismatch-metrics reports what a --custom-tis-function-path computes"),
    (["--custom-tis-function-path", "a.b"], "called only with --use-tis or --get-mismatch-metrics"),
    (["--disable-compute-advantages-and-returns"], "leaves the policy loss without advantages"),
    (["--loss-type", "sft_loss", "--custom-pg-loss-reducer-function-path", "a.b"], "has none: drop it"),
    (["--loss-type", "custom_loss", "--custom-loss-function-path", "a.b", "--context-parallel-size", "2",
      "--actor-num-gpus-per-node", "2"], "--context-parallel-size 1"),
    (["--custom-loss-function-path", "not a path"], "must look like module.path.function"),
])
def test_loss_flag_rules_fail_with_one_line(argv, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, "train_async")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_miles_line_with_the_loss_hooks_loads() -> None:
    config, _ = load_config(["--loss-type", "custom_loss", "--custom-loss-function-path", f"{HOOKS}.plain_policy_loss",
                             "--use-tis", "--custom-tis-function-path", f"{HOOKS}:truncate_and_mask",
                             "--get-mismatch-metrics",
                             "--custom-pg-loss-reducer-function-path", f"{HOOKS}.get_pg_loss_reducer"], "train_async")
    assert config.train.loss_type == "custom_loss" and config.train.get_mismatch_metrics
    hooks = TrainObjective(config.train).hooks
    assert hooks.custom_loss.__name__ == "plain_policy_loss" and hooks.tis.__name__ == "truncate_and_mask"
    assert hooks.pg_loss_reducer.__name__ == "get_pg_loss_reducer" and not hooks.custom_loss_takes_parallel_state
