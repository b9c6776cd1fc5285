"""On-policy distillation (``--use-opd``) against an independent float64 implementation of miles'
formulas in plain Python floats: each response token's advantage loses ``opd_kl_coef * (student -
teacher)`` after the estimator and before ``--normalize-advantages`` (miles'
``apply_opd_kl_to_advantages``), the student being the logprobs the advantages are computed from
(the trainer's recomputed ones, or the engines' with ``--use-rollout-logprobs``); the policy loss
trains on those advantages; ``train/opd_reverse_kl`` is reduced as the loss is. Per sample and per
token, and a batch split over two "ranks" gives what one gives. Plus the flags' rules."""

from __future__ import annotations

import math

import pytest
import torch

from miles_disagg.config import load_config
from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.objective import TrainObjective
from miles_disagg.trainer.rollout_inputs import prepare_rollout
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError, InvalidInput

MASKS = [[1, 1, 0, 1, 1], [1, 1, 1], [0, 0], [1, 0, 1, 1]]
SIGNALS = (1.5, -0.8, 0.4, -2.0)
TOLERANCE = 1e-6


def data(seed: int = 0):
    """Ragged samples (a tool token, a sample without trained tokens) with float64 engine, teacher,
    recomputed and current logprobs."""
    generator = torch.Generator().manual_seed(seed)

    def logprobs(n: int) -> list[float]:
        return (-torch.rand(n, generator=generator, dtype=torch.float64) * 2).tolist()

    samples = [Sample(prompt_ids=[1, 2], response_ids=[3] * len(mask), response_logprobs=logprobs(len(mask)),
                      loss_mask=mask, advantage=SIGNALS[i], teacher_logprobs=logprobs(len(mask)))
               for i, mask in enumerate(MASKS)]
    width = max(len(m) for m in MASKS)
    old = -torch.rand((len(MASKS), width), generator=generator, dtype=torch.float64) * 2
    current = old + 0.3 * torch.randn(old.shape, generator=generator, dtype=torch.float64)
    return samples, old, current


def float64_batch(samples: list[Sample]):
    """``pack`` with the per-token fields in float64 (pack keeps the trainer's float32)."""
    batch = pack(samples)
    width = batch.loss_mask.shape[1]
    for name, values in (("rollout_logprobs", [s.response_logprobs for s in samples]),
                         ("teacher_logprobs", [s.teacher_logprobs for s in samples])):
        table = torch.zeros((len(samples), width), dtype=torch.float64)
        for i, row in enumerate(values):
            table[i, :len(row)] = torch.tensor(row, dtype=torch.float64)
        setattr(batch, name, table)
    batch.advantages = batch.advantages.double()
    return batch


# ------------------------------------------------------------------ miles' formulas, in plain floats


def miles_opd_advantages(signals, student, teacher, masks, coef: float, normalize: bool) -> list[list[float]]:
    """GRPO's per-token advantage (the sample's signal on every response token), minus
    ``coef * (student - teacher)`` per token, then (``normalize``) miles' masked whitening:
    ``(A - mean) / sqrt(var + 1e-8)`` over the trained tokens, unbiased variance."""
    advantages = [[a - coef * (s - t) for s, t in zip(srow, trow)]
                  for a, srow, trow in zip(signals, student, teacher)]
    if not normalize:
        return advantages
    values = [v for row, mask in zip(advantages, masks) for v, m in zip(row, mask) if m]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return [[(v - mean) / math.sqrt(var + 1e-8) for v in row] for row in advantages]


def miles_policy_loss(current, old, advantages, masks, *, per_token: bool, eps=0.2, eps_high=0.28) -> float:
    """miles' PPO clipped surrogate per token, reduced in sum form (per sample: each sample's mean)."""
    total = 0.0
    for lp, o, adv, mask in zip(current, old, advantages, masks):
        tokens = []
        for ll, oo, a, m in zip(lp, o, adv, mask):
            ratio = math.exp(max(-20.0, min(20.0, ll - oo)))
            tokens.append(max(-ratio * a, -min(max(ratio, 1 - eps), 1 + eps_high) * a) * m)
        total += sum(tokens) if per_token else sum(tokens) / max(sum(mask), 1)
    return total


def miles_reduced(values, masks, *, per_token: bool) -> float:
    """``sum_of_sample_mean`` in sum form."""
    return sum(sum(v * m for v, m in zip(row, mask)) / (1 if per_token else max(sum(mask), 1))
               for row, mask in zip(values, masks))


def rows(values: torch.Tensor, masks=MASKS) -> list[list[float]]:
    return [values[i, :len(m)].tolist() for i, m in enumerate(masks)]


# ------------------------------------------------------------------ the term


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "whitened"])
@pytest.mark.parametrize("rollout_logprobs", [False, True], ids=["recomputed", "engine"])
def test_opd_advantages_loss_and_metric_match_miles(per_token, normalize, rollout_logprobs) -> None:
    samples, old, current = data()
    config = TrainConfig(use_opd=True, opd_type="sglang", opd_kl_coef=0.7, calculate_per_token_loss=per_token,
                         normalize_advantages=normalize, use_rollout_logprobs=rollout_logprobs,
                         eps_clip=0.2, eps_clip_high=0.28)
    batch = float64_batch(samples)
    inputs = prepare_rollout(config, [[batch]], [old.clone()], [None])
    frozen = inputs.micro[0]
    student = rows(batch.rollout_logprobs) if rollout_logprobs else rows(old)
    teacher = [s.teacher_logprobs for s in samples]
    masks = [[float(m) for m in mask] for mask in MASKS]
    expected = miles_opd_advantages(SIGNALS, student, teacher, masks, 0.7, normalize)
    for got, want in zip(rows(frozen.advantages), expected):
        assert got == pytest.approx(want, abs=TOLERANCE)
    assert rows(frozen.opd_reverse_kl) == [pytest.approx([s - t for s, t in zip(srow, trow)], abs=TOLERANCE)
                                           for srow, trow in zip(student, teacher)]
    assert frozen.opd_reverse_kl[0, len(MASKS[0]):].abs().sum() == 0  # nothing on padding

    loss, metrics = TrainObjective(config)(batch, frozen, current, None, None, torch.device("cpu"))
    behaviour = student if rollout_logprobs else rows(old)
    assert loss.item() == pytest.approx(miles_policy_loss(rows(current), behaviour, expected, masks,
                                                          per_token=per_token), abs=TOLERANCE)
    reverse_kl = [[s - t for s, t in zip(srow, trow)] for srow, trow in zip(student, teacher)]
    assert metrics["train/opd_reverse_kl"] == pytest.approx(miles_reduced(reverse_kl, masks, per_token=per_token),
                                                            abs=TOLERANCE)


def test_without_use_opd_the_teacher_changes_nothing() -> None:
    samples, old, current = data(1)
    batch = float64_batch(samples)
    plain = prepare_rollout(TrainConfig(), [[batch]], [old.clone()], [None]).micro[0]
    assert plain.opd_reverse_kl is None
    assert torch.equal(plain.advantages, batch.advantages.unsqueeze(-1) * batch.response_mask)
    zero = prepare_rollout(TrainConfig(use_opd=True, opd_type="sglang", opd_kl_coef=0.0), [[batch]],
                           [old.clone()], [None]).micro[0]
    assert torch.equal(zero.advantages, plain.advantages)  # miles: a zero coefficient is a no-op
    _, metrics = TrainObjective(TrainConfig())(batch, plain, current, None, None, torch.device("cpu"))
    assert "train/opd_reverse_kl" not in metrics


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_two_ranks_give_what_one_gives(per_token) -> None:
    """Whitening and the metric over two ranks' shares (sum form over the global denominator) equal the
    whole batch's (the whitening's statistics are the rollout's, so the fake group sums both halves)."""
    samples, old, current = data(2)
    config = TrainConfig(use_opd=True, opd_type="sglang", opd_kl_coef=1.3, calculate_per_token_loss=per_token,
                         normalize_advantages=True)
    whole = float64_batch(samples)
    one = prepare_rollout(config, [[whole]], [old.clone()], [None]).micro[0]
    _, whole_metrics = TrainObjective(config)(whole, one, current, None, None, torch.device("cpu"))
    halves = [[0, 2], [1, 3]]
    batches = [float64_batch([samples[i] for i in h]) for h in halves]
    olds = [old[h, :b.loss_mask.shape[1]].clone() for h, b in zip(halves, batches)]
    both = prepare_rollout(config, [batches], olds, [None, None])  # one "rank" holding both shares
    total = 0.0
    for h, b, frozen in zip(halves, batches, both.micro):
        width = b.loss_mask.shape[1]
        assert torch.allclose(frozen.advantages, one.advantages[h, :width], atol=TOLERANCE)
        _, metrics = TrainObjective(config)(b, frozen, current[h, :width], None, None, torch.device("cpu"))
        total += metrics["train/opd_reverse_kl"]
    assert total == pytest.approx(whole_metrics["train/opd_reverse_kl"], abs=TOLERANCE)


def test_missing_teacher_logprobs_are_an_error_not_a_silent_zero() -> None:
    samples, old, _ = data(3)
    config = TrainConfig(use_opd=True, opd_type="sglang")
    bare = [Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, response_logprobs=s.response_logprobs,
                   loss_mask=s.loss_mask) for s in samples]
    with pytest.raises(ValueError, match="teacher logprobs"):
        prepare_rollout(config, [[pack(bare)]], [old.clone()], [None])
    with pytest.raises(ValueError, match="sample 1: none teacher logprobs"):
        pack([samples[0], bare[1]])
    with pytest.raises(ValueError, match="skip-actor-forward-only"):
        prepare_rollout(config, [[pack(samples)]], [None], [None])


def test_the_sample_keeps_miles_name_and_checks_the_length() -> None:
    sample = Sample(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -2.0])
    sample.teacher_log_probs = torch.tensor([-0.5, -0.25])  # how a miles post-process hook sets it
    assert sample.teacher_logprobs == [-0.5, -0.25] and sample.teacher_log_probs == [-0.5, -0.25]
    sample.check_consistent()
    sample.teacher_logprobs = [-0.5]
    with pytest.raises(InvalidInput, match="teacher logprobs"):
        sample.check_consistent()


# ------------------------------------------------------------------ the flags


BASE = ["--train-backend", "fsdp", "--hf-checkpoint", "/tmp/none", "--rollout-batch-size", "2",
        "--global-batch-size", "2"]


def config_of(*flags: str, entry: str = "train"):
    return load_config([*BASE, *flags], entry=entry)[0]


def test_miles_defaults_and_names() -> None:
    config = config_of()
    assert (config.train.use_opd, config.train.opd_type, config.train.opd_kl_coef) == (False, None, 1.0)
    assert config.rollout.rm_url is None and config.rollout.opd_teacher_hf_checkpoint is None
    config = config_of("--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "0.5", "--rm-url", "http://t:1/generate")
    assert (config.train.use_opd, config.train.opd_type, config.train.opd_kl_coef) == (True, "sglang", 0.5)
    assert config.rollout.rm_url == "http://t:1/generate"


@pytest.mark.parametrize("flags, named", [
    (["--use-opd", "--rm-url", "http://t:1/generate"], "--opd-type"),
    (["--use-opd", "--opd-type", "megatron", "--opd-teacher-load", "/x"], "--opd-type megatron is a miles flag"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate", "--opd-teacher-load", "/x"],
     "--opd-teacher-load"),
    (["--use-opd", "--opd-type", "sglang"], "needs its teacher"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate", "--opd-teacher-hf-checkpoint", "/t"],
     "give one"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "t:1"], "expected the teacher's"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/score"], "expected the teacher's"),
    (["--use-opd", "--opd-type", "sglang", "--opd-teacher-hf-checkpoint", "/nonexistent"], "not a readable"),
    (["--opd-teacher-hf-checkpoint", "/t"], "add --use-opd"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate", "--skip-actor-forward-only"],
     "--skip-actor-forward-only"),
    (["--use-opd", "--opd-type", "sglang", "--rm-url", "http://t:1/generate", "--loss-type", "sft_loss",
      "--disable-compute-advantages-and-returns"], "--disable-compute-advantages-and-returns"),
])
def test_refused_combinations_name_their_flags(flags, named) -> None:
    with pytest.raises(ConfigError, match=named.replace("-", r"\-")):
        config_of(*flags)


def test_opd_teacher_load_without_use_opd_is_refused_as_miles_refuses_it() -> None:
    with pytest.raises(ConfigError) as info:
        config_of("--opd-teacher-load", "/teacher")
    assert info.value.flags == ("--opd-teacher-load", "--use-opd") and "add --use-opd" in str(info.value)
    assert "\n" not in str(info.value)
    assert config_of().train.opd_teacher_load is None  # without it the line loads


def test_a_teacher_with_another_vocabulary_is_refused(tmp_path) -> None:
    import json

    student, teacher = tmp_path / "student", tmp_path / "teacher"
    for path, vocab in ((student, 64), (teacher, 65)):
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"vocab_size": vocab}))
    flags = ["--use-opd", "--opd-type", "sglang", "--opd-teacher-hf-checkpoint", str(teacher)]
    with pytest.raises(ConfigError, match="same vocabulary"):
        load_config([*BASE[:2], "--hf-checkpoint", str(student), *BASE[4:], *flags], entry="train")
    (teacher / "config.json").write_text(json.dumps({"vocab_size": 64}))
    config, _ = load_config([*BASE[:2], "--hf-checkpoint", str(student), *BASE[4:], *flags], entry="train")
    assert config.rollout.opd_teacher_hf_checkpoint == str(teacher)


def test_a_miles_opd_line_runs_miles_recipe_unchanged() -> None:
    """miles' SGLang-teacher recipe (its reward function and post-process by their miles paths): the
    rollout asks the teacher itself, the reward is 0 and the post-process gives miles' zeros, so only
    the OPD term trains (pure distillation, as in miles)."""
    import asyncio
    from types import SimpleNamespace

    from miles_disagg.rollout.generate import GenerationFailed
    from miles_disagg.rollout.hooks import load_rollout_hooks
    from miles_disagg.rollout.sample_rewards import load_sample_reward

    recipe = "miles.rollout.on_policy_distillation"
    config = config_of("--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "1.0", "--rm-url", "http://t:1/generate",
                       "--custom-rm-path", f"{recipe}.reward_func",
                       "--custom-reward-post-process-path", f"{recipe}.post_process_rewards")
    reward, hooks = load_sample_reward(config.rollout), load_rollout_hooks(config.rollout)
    samples = [Sample(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -1.0], reward=None,
                      teacher_logprobs=[-0.5, -0.5]) for _ in range(2)]
    asyncio.run(reward.score(SimpleNamespace(evaluation=False), samples))
    assert [s.reward for s in samples] == [0.0, 0.0]
    assert hooks.reward_post_process(SimpleNamespace(), samples) == ([0.0, 0.0], [0.0, 0.0])
    samples[1].teacher_logprobs = None
    with pytest.raises(GenerationFailed, match="no teacher logprobs"):
        hooks.reward_post_process(SimpleNamespace(), samples)
