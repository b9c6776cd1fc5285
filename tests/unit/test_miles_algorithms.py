"""miles' algorithm flags, each against an independent, element-by-element implementation of miles'
formula (plain Python floats): ``--eps-clip-c`` (dual clip), ``--tis-clip-low``, ``--kl-loss-type k3``,
``--use-unbiased-kl``, ``--disable-grpo-std-normalization``, ``--disable-rewards-normalization``, the
per-token loss denominator (each sample's trained tokens clamped at 1), ``train_rollout_logprob_abs_diff``
(per sample, per token, 0 with rollout logprobs), the [-20, 20] log-ratio clamp of miles' current loss
code, the ``k1`` default, the two combinations miles rejects, and equal-reward GRPO groups."""

from __future__ import annotations

import math
import statistics
from types import SimpleNamespace

import pytest
import torch

from miles_disagg.config import load_config
from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.losses import kl_penalty, policy_loss, tis_weights
from miles_disagg.trainer.policy_gradient import rl_loss
from miles_disagg.trainer.rollout_inputs import prepare_rollout
from miles_disagg.trainer.sequence_advantages import assign_advantages
from miles_disagg.samples import Group, Sample
from miles_disagg.types import ConfigError

LOGPROBS = [[-0.2, -1.5, -0.7], [-2.0, -0.1, -0.9]]
OLD = [[-0.9, -0.3, -0.7], [-0.5, -1.2, -0.2]]
ROLLOUT = [[-0.1, -2.5, -0.8], [-0.4, -1.0, -3.0]]
REF = [[-0.6, -0.6, -1.9], [-1.1, -0.05, -0.3]]
ADV = [1.5, -2.0]


def clamp20(log_ratio: float) -> float:
    """miles' guard before exp: NaN -> 0, then [-20, 20]."""
    return 0.0 if math.isnan(log_ratio) else max(-20.0, min(20.0, log_ratio))


def miles_pg(logprob: float, old: float, adv: float, eps: float, eps_high: float, eps_c: float | None) -> float:
    ratio = math.exp(clamp20(logprob - old))
    loss1, loss2 = -ratio * adv, -min(max(ratio, 1 - eps), 1 + eps_high) * adv
    clipped = max(loss1, loss2)
    if eps_c is None:
        return clipped
    return min(-eps_c * adv, clipped) if adv < 0 else clipped


def miles_kl(logprob: float, ref: float, kind: str, ratio: float | None) -> float:
    log_ratio = logprob - ref
    kl = {"k1": log_ratio, "k2": log_ratio ** 2 / 2, "k3": math.exp(-log_ratio) - 1 + log_ratio,
          "low_var_kl": math.exp(clamp20(-log_ratio)) - 1 - clamp20(-log_ratio)}[kind]
    kl = kl * ratio if ratio is not None else kl
    return max(-10.0, min(10.0, kl)) if kind == "low_var_kl" else kl


@pytest.mark.parametrize("eps_c", [None, 3.0, 1.05])
def test_dual_clip_matches_miles(eps_c) -> None:
    out = policy_loss(torch.tensor(LOGPROBS), torch.tensor(OLD), torch.tensor(ADV), eps_clip=0.2,
                      eps_clip_high=0.28, eps_clip_c=eps_c).per_token
    for i, row in enumerate(LOGPROBS):
        for j, lp in enumerate(row):
            assert out[i, j].item() == pytest.approx(miles_pg(lp, OLD[i][j], ADV[i], 0.2, 0.28, eps_c), rel=1e-5)
    if eps_c == 1.05:  # the bound binds somewhere for a strongly negative advantage
        assert out[1, 1].item() == pytest.approx(-1.05 * ADV[1])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
@pytest.mark.parametrize("unbiased", [False, True])
def test_kl_estimators_match_miles(kind, unbiased) -> None:
    lp, old, ref = torch.tensor(LOGPROBS), torch.tensor(OLD), torch.tensor(REF)
    ratio = torch.exp(lp - old) if unbiased else None
    out = kl_penalty(lp, ref, kind, ratio)
    for i, row in enumerate(LOGPROBS):
        for j, value in enumerate(row):
            r = math.exp(value - OLD[i][j]) if unbiased else None
            assert out[i, j].item() == pytest.approx(miles_kl(value, REF[i][j], kind, r), rel=1e-5, abs=1e-7)


def test_k3_is_low_var_kl_without_the_clamp() -> None:
    lp, ref = torch.tensor([[0.0]]), torch.tensor([[-20.0]])
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(math.exp(-20.0) - 1 + 20.0)
    assert kl_penalty(lp, ref, "low_var_kl").item() == 10.0


def test_tis_clip_low_matches_miles() -> None:
    out = tis_weights(torch.tensor(OLD), torch.tensor(ROLLOUT), clip=2.0, clip_low=0.5)
    for i, row in enumerate(OLD):
        for j, value in enumerate(row):
            assert out[i, j].item() == pytest.approx(min(max(math.exp(value - ROLLOUT[i][j]), 0.5), 2.0), rel=1e-5)


def batch_of_two():
    a = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], response_logprobs=ROLLOUT[0], advantage=ADV[0],
               loss_mask=[1, 0, 1])
    b = Sample(prompt_ids=[5, 6], response_ids=[7, 8, 9], response_logprobs=ROLLOUT[1], advantage=ADV[1],
               loss_mask=[0, 0, 0])  # no trained token: counts as one in the per-token denominator
    return pack([a, b])


def test_rl_loss_wires_every_miles_flag() -> None:
    config = TrainConfig(eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0, use_tis=True, tis_clip=2.0,
                         tis_clip_low=0.5, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3",
                         use_unbiased_kl=True, calculate_per_token_loss=True)
    batch = batch_of_two()
    lp, old, ref = torch.tensor(LOGPROBS), torch.tensor(OLD), torch.tensor(REF)
    loss, metrics = rl_loss(config, batch, lp, torch.zeros_like(lp), old, ref,
                            batch.advantages.unsqueeze(-1).expand_as(lp), torch.device("cpu"))
    expected_pg = expected_kl = 0.0
    for j in (0, 2):  # sample a's trained tokens
        tis = min(max(math.exp(OLD[0][j] - ROLLOUT[0][j]), 0.5), 2.0)
        expected_pg += miles_pg(LOGPROBS[0][j], OLD[0][j], ADV[0], 0.2, 0.28, 3.0) * tis
        expected_kl += miles_kl(LOGPROBS[0][j], REF[0][j], "k3", math.exp(LOGPROBS[0][j] - OLD[0][j]))
    assert metrics["train/pg_loss"] == pytest.approx(expected_pg, rel=1e-5)
    assert metrics["train/kl_loss"] == pytest.approx(expected_kl, rel=1e-5)
    assert loss.item() == pytest.approx(expected_pg + 0.1 * expected_kl, rel=1e-5)
    assert batch.num_tokens == 2 + 1  # per-token denominator: sample b's zero tokens count as one


@pytest.mark.parametrize("flags, expected", [
    ({}, ((abs(OLD[0][0] - ROLLOUT[0][0]) + abs(OLD[0][2] - ROLLOUT[0][2])) / 2 + 0.0) / 2),  # per-sample mean
    # per token: over the loss's token count (sample b, with no trained token, counts as one)
    ({"calculate_per_token_loss": True}, (abs(OLD[0][0] - ROLLOUT[0][0]) + abs(OLD[0][2] - ROLLOUT[0][2])) / 3),
    ({"use_rollout_logprobs": True}, 0.0),  # the behaviour logprobs are the engines': miles reports 0
])
def test_the_logprob_abs_diff_follows_miles(flags, expected) -> None:
    batch = batch_of_two()
    prepared = prepare_rollout(TrainConfig(**flags), [[batch]], [torch.tensor(OLD, dtype=torch.float64)], [None])
    assert prepared.metrics["train/train_rollout_logprob_abs_diff"] == pytest.approx(expected, abs=1e-6)


def groups(*rewards: list[float]) -> list[Group]:
    return [Group(prompt_index=i, samples=[Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0],
                                                  reward=r) for r in rs]) for i, rs in enumerate(rewards)]


@pytest.mark.parametrize("flags, expected", [
    ({}, lambda rs: [(r - statistics.mean(rs)) / (statistics.stdev(rs) + 1e-6) for r in rs]),
    ({"disable_grpo_std_normalization": True}, lambda rs: [r - statistics.mean(rs) for r in rs]),
    ({"disable_rewards_normalization": True}, lambda rs: list(rs)),
])
def test_grpo_normalization_flags_match_miles(flags, expected) -> None:
    rewards = [[1.0, 0.0, 0.5, 0.25], [3.0, -1.0]]
    config = SimpleNamespace(**{"advantage_estimator": "grpo", "disable_grpo_std_normalization": False,
                                "disable_rewards_normalization": False, **flags})
    samples = assign_advantages(groups(*rewards), config)
    assert [s.advantage for s in samples] == pytest.approx([a for rs in rewards for a in expected(rs)], rel=1e-5)


def test_a_miles_algorithm_line_loads_and_the_old_name_is_refused(tmp_path) -> None:
    line = ["--disable-grpo-std-normalization", "--eps-clip-c", "3", "--tis-clip-low", "0.1", "--kl-loss-type",
            "k3", "--use-unbiased-kl", "--use-tis", "--use-kl-loss", "--disable-rewards-normalization"]
    config, _ = load_config(line, "train_async")
    train = config.train
    assert (train.disable_grpo_std_normalization, train.eps_clip_c, train.tis_clip_low, train.kl_loss_type,
            train.use_unbiased_kl, train.disable_rewards_normalization) == (True, 3.0, 0.1, "k3", True, True)
    for old in ("--no-normalize-advantages-by-std", "--normalize-advantages-by-std"):
        with pytest.raises(ConfigError, match="--disable-grpo-std-normalization"):
            load_config([old], "train_async")
    with pytest.raises(ConfigError, match="--eps-clip-c"):
        load_config(["--eps-clip-c", "0.5"], "train_async")


@pytest.mark.parametrize("log_ratio, adv, expected", [
    (25.0, -1.0, math.exp(20.0)),  # clamped: 4.9e8, not exp(25) = 7.2e10
    (-30.0, 1.0, -math.exp(-20.0)),  # the pessimistic (unclipped) branch, at the clamped ratio
    (float("nan"), 2.0, -2.0),  # NaN -> a ratio of 1
    (float("inf"), -0.5, 0.5 * math.exp(20.0)),
])
def test_the_ppo_ratio_clamps_the_log_ratio_as_miles_does(log_ratio, adv, expected) -> None:
    old = torch.zeros(1, 1, dtype=torch.float64)
    out = policy_loss(torch.tensor([[log_ratio]], dtype=torch.float64), old, torch.tensor([adv], dtype=torch.float64),
                      eps_clip=0.2).per_token.item()
    assert out == pytest.approx(expected, rel=1e-9)
    if not math.isnan(log_ratio) and not math.isinf(log_ratio):
        assert out == pytest.approx(miles_pg(log_ratio, 0.0, adv, 0.2, 0.2, None), rel=1e-9)


def test_low_var_kl_clamps_the_log_ratio_before_exp_and_k3_does_not() -> None:
    lp, ref = torch.tensor([[-25.0]], dtype=torch.float64), torch.tensor([[0.0]], dtype=torch.float64)
    ratio = torch.tensor([[math.exp(-18.0)]], dtype=torch.float64)  # --use-unbiased-kl's exp(logprob - old)
    low_var = kl_penalty(lp, ref, "low_var_kl", ratio).item()
    assert low_var == pytest.approx(math.exp(-18.0) * (math.exp(20.0) - 1 - 20.0), rel=1e-9)  # e^2 - 21e^-18
    assert low_var == pytest.approx(miles_kl(-25.0, 0.0, "low_var_kl", math.exp(-18.0)), rel=1e-9)
    assert kl_penalty(lp, ref, "k3", ratio).item() == pytest.approx(math.exp(-18.0) * (math.exp(25.0) - 1 - 25.0),
                                                                    rel=1e-9)


def test_print_config_of_a_miles_kl_line_shows_k1(capsys) -> None:
    from miles_disagg.launcher import main

    assert TrainConfig().kl_loss_type == "k1"
    assert main("train_async", ["--use-kl-loss", "--kl-loss-coef", "0.01", "--print-config"]) == 0
    shown = capsys.readouterr().out
    assert "kl_loss_type: k1" in shown and "use_kl_loss: true" in shown


@pytest.mark.parametrize("argv, message", [
    (["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages", "--kl-coef", "0.1",
      "--use-kl-loss", "--kl-loss-coef", "0.01"], "only one of them can be set (miles refuses both too)"),
    (["--advantage-estimator", "reinforce_plus_plus"], "reinforce_plus_plus requires advantage normalization"),
    (["--advantage-estimator", "reinforce_plus_plus_baseline"], "add --normalize-advantages"),
])
def test_the_combinations_miles_rejects_are_rejected(argv, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, "train_async")
    assert message in str(info.value) and "\n" not in str(info.value)
    load_config(["--kl-coef", "0.1", "--kl-loss-coef", "0", "--advantage-estimator", "reinforce_plus_plus",
                 "--normalize-advantages", "--use-kl-loss"], "train_async")  # a zero --kl-loss-coef is fine


def test_equal_reward_groups_get_exactly_zero_and_the_others_miles_values() -> None:
    """Decided against miles' float32 residue (see ``grpo_advantages``): equal rewards give 0; every
    other group agrees with miles' formula evaluated in float64."""
    generator = torch.Generator().manual_seed(0)
    values = [0.1, 0.2, 1 / 3, 0.7, 2 / 3, 0.9, 1.1, 0.05]
    for size in (2, 3, 8, 16):
        for _ in range(50):
            picks = torch.randint(0, len(values), (size,), generator=generator).tolist()
            equal = [values[picks[0]] * 3] * size
            varied = [values[p] for p in picks]
            got = assign_advantages(groups(equal, varied), SimpleNamespace(
                advantage_estimator="grpo", disable_grpo_std_normalization=False, disable_rewards_normalization=False))
            assert [s.advantage for s in got[:size]] == [0.0] * size
            if len(set(varied)) > 1:  # miles' formula in float64 on its float32 rewards
                rounded = torch.tensor(varied, dtype=torch.float32).double().tolist()
                mean = statistics.fmean(rounded)
                centered = [r - mean for r in rounded]
                std = statistics.stdev(centered)
                # float32 arithmetic, as miles': the mean's rounding over a small spread costs ~1e-6 relative
                assert [s.advantage for s in got[size:]] == pytest.approx([c / (std + 1e-6) for c in centered],
                                                                         rel=1e-5, abs=1e-6)


def test_reset_optimizer_states_clears_adam_history_in_place() -> None:
    from types import SimpleNamespace as Holder

    from miles_disagg.trainer.optimizer_reset import reset_optimizer_states

    weight = torch.nn.Parameter(torch.ones(3))
    adam = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.tensor([1.0, -2.0, 3.0])
    adam.step()
    first = weight.detach().clone()
    moment = adam.state[weight]["exp_avg"]
    assert reset_optimizer_states(Holder(optim=Holder(optimizer=adam))) == 1  # found through the wrappers
    assert adam.state[weight]["exp_avg"] is moment and moment.abs().sum() == 0 and adam.state[weight]["step"] == 0
    fresh = torch.nn.Parameter(first.clone())
    fresh_adam = torch.optim.AdamW([fresh], lr=0.1)
    for param, optimizer in ((weight, adam), (fresh, fresh_adam)):
        param.grad = torch.tensor([0.5, 0.5, -1.0])
        optimizer.step()
    assert torch.equal(weight.detach(), fresh.detach())  # the next step is a fresh optimizer's
    with pytest.raises(ValueError, match="no optimizer found"):
        reset_optimizer_states(Holder())


@pytest.mark.parametrize("argv, message", [
    (["--skip-actor-forward-only", "--num-steps-per-rollout", "2", "--rollout-batch-size", "4"],
     "one optimizer step per rollout"),
    (["--skip-actor-forward-only", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
      "--global-batch-size", "4"], "give --global-batch-size 8"),
    (["--skip-actor-forward-only", "--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages",
      "--kl-coef", "0.1"], "--skip-actor-forward-only with --kl-coef"),
    (["--use-rollout-entropy"], "--use-rollout-entropy is a miles flag that does not apply here"),
])
def test_miles_loss_flags_refused_with_one_line(argv, message) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, "train_async")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_miles_loss_flags_accepted() -> None:
    line = ["--skip-actor-forward-only", "--use-rollout-logprobs", "--rollout-batch-size", "4",
            "--n-samples-per-prompt", "2", "--global-batch-size", "8", "--reset-optimizer-states",
            "--observe-training-entropy", "--use-opsm", "--opsm-delta", "0.001"]
    train = load_config(line, "train_async")[0].train
    assert (train.skip_actor_forward_only, train.reset_optimizer_states, train.observe_training_entropy,
            train.use_opsm, train.opsm_delta, train.train_backend) == (True, True, True, True, 0.001, "megatron")
    sft = load_config(["--loss-type", "sft_loss", "--disable-compute-advantages-and-returns"], "train_async")[0].train
    assert sft.disable_compute_advantages_and_returns and sft.loss_type == "sft_loss"


SKIP = ["--skip-actor-forward-only", "--use-rollout-logprobs", "--rollout-batch-size", "4", "--n-samples-per-prompt",
        "2", "--global-batch-size", "8"]


@pytest.mark.parametrize("extra, flags", [
    (["--train-backend", "fsdp"], ("--skip-actor-forward-only", "--train-backend")),
    (["--loss-type", "sft_loss", "--disable-compute-advantages-and-returns"],
     ("--skip-actor-forward-only", "--loss-type")),
    (["--advantage-estimator", "reinforce_plus_plus", "--normalize-advantages", "--kl-coef", "0.1"],
     ("--skip-actor-forward-only", "--kl-coef")),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate"],
     ("--skip-actor-forward-only", "--use-opd")),
], ids=["fsdp", "sft_loss", "kl-coef", "use-opd"])
def test_skip_actor_forward_only_refused_as_miles_refuses_it(extra, flags) -> None:
    """miles refuses ``--skip-actor-forward-only`` off Megatron, with sft_loss, and with --kl-coef or
    --use-opd even beside --use-rollout-logprobs; each without the skip is accepted."""
    with pytest.raises(ConfigError) as info:
        load_config(SKIP + extra, "train_async")
    assert info.value.flags == flags and "\n" not in str(info.value)
    load_config(SKIP[1:] + extra, "train_async")  # the same line without the skip
