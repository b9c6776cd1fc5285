"""The trainer group on real Ray (logical GPUs, gloo): data parallelism is exact, export is canonical,
and a checkpoint written by two ranks resumes on one.

The loss is normalised over the whole global batch (miles' per-sample mean by default,
``--calculate-per-token-loss`` for the token mean), so two ranks training on a ragged batch
with tool tokens masked out must compute exactly what one rank computes: the same loss, the
same gradient (its norm, before clipping, at every optimizer step) and the same weights.
"""

from __future__ import annotations

import dataclasses

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from checkpoint_reading import assert_same_state, read_state
from ragged_batch import ragged_samples as samples

from miles_disagg.config.components import TrainConfig, WeightUpdateConfig

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def pool():
    """Trainer rank processes on a private Ray, hosting every group of the module in turn."""
    from rank_pool import private_ray_pool

    with private_ray_pool() as ranks:
        yield ranks


@contextmanager
def trainer_group(pool, world_size: int, model_dir: Path, train: TrainConfig):
    """A set-up fsdp TrainerGroup of ``world_size`` of the pool's ranks (released on exit)."""
    from miles_disagg.config.actors import TrainerGroupConfig

    train = dataclasses.replace(train, train_backend="fsdp")
    config = TrainerGroupConfig(train=train, weights=WeightUpdateConfig(), hf_dir=str(model_dir))
    with pool.group(world_size, config) as group:
        assert group.setup_info["backend"] == "gloo"
        yield group


def train_with(pool, world_size: int, model_dir: Path, **flags):
    """(the rollout's TrainResult, rank 0's exported bytes after it)."""
    # adam_eps 1: a first Adam step of lr * g / (|g| + 1) ~ lr * g, so the weights show the gradient's
    # scale and direction (with the default eps Adam's first step is ~ lr * sign(g), blind to scale).
    train = TrainConfig(lr=1.0, adam_eps=1.0, global_batch_size=4, micro_batch_size=1, seed=0, clip_grad=0.0,
                        **flags)
    batch = samples()
    for sample in batch if train.use_opd else []:  # a teacher that disagrees token by token
        sample.teacher_logprobs = [-3.0 - 0.2 * t for t in range(len(sample.response_ids))]
    with trainer_group(pool, world_size, model_dir, train) as group:
        result = group.train(batch)
        return result, group.tensor_bytes()


@pytest.fixture(scope="module")
def trained(pool, tiny_qwen3_dir: Path):
    """``trained(world_size, **flags)``: a cached ``train_with`` (each run starts Ray actors: slow)."""
    cache: dict = {}

    def run(world_size: int, **flags):
        key = (world_size, tuple(sorted(flags.items())))
        if key not in cache:
            cache[key] = train_with(pool, world_size, tiny_qwen3_dir, **flags)
        return cache[key]

    return run


def assert_same_training(one, two, base: dict[str, torch.Tensor]) -> None:
    (one_result, one_bytes), (two_result, two_bytes) = one, two
    assert len(one_result.steps) == len(two_result.steps) == 2  # 8 samples, global batch 4
    for a, b in zip(one_result.steps, two_result.steps):
        for key in ("train/loss", "train/pg_loss", "train/entropy", "train/ppo_kl", "train/pg_clipfrac"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)  # the same gradient
    changed = 0
    for name, tensor in base.items():
        a = torch.frombuffer(bytearray(one_bytes[name]), dtype=tensor.dtype).view(tensor.shape)
        b = torch.frombuffer(bytearray(two_bytes[name]), dtype=tensor.dtype).view(tensor.shape)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7), name
        changed += not torch.equal(a, tensor)
    assert changed > len(base) // 2  # the steps really moved the policy


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_two_ranks_match_one_rank(trained, tiny_qwen3_dir: Path, per_token: bool) -> None:
    from safetensors.torch import load_file

    base = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
    one = trained(1, calculate_per_token_loss=per_token)
    two = trained(2, calculate_per_token_loss=per_token)
    assert set(one[1]) == set(two[1]) == set(base)  # canonical HF names, nothing more, nothing less
    assert_same_training(one, two, base)
    first = one[0].steps[0]
    assert first["train/ppo_kl"] == 0.0 and first["train/pg_clipfrac"] == 0.0  # on-policy: ratio exactly 1
    assert one[0].rollout["train/train_rollout_logprob_abs_diff"] > 0  # -4.0 is not what the model says


def test_the_two_modes_differ_and_kl_is_logged_at_coefficient_zero(trained) -> None:
    """With --use-kl-loss --kl-loss-coef 0 the reference is loaded and train/kl_loss logged (0 at the
    first step: the reference is the base policy) without changing the update; REINFORCE++ with
    --kl-coef and whitening trains through the same ranks."""
    per_sample, per_sample_bytes = trained(1, calculate_per_token_loss=False)
    watched, watched_bytes = trained(1, use_kl_loss=True, kl_loss_coef=0.0)
    assert "train/kl_loss" not in per_sample.steps[0]
    assert watched.steps[0]["train/kl_loss"] == 0.0 and watched.steps[1]["train/kl_loss"] > 0
    assert watched_bytes == per_sample_bytes  # logged, not trained on
    per_token, _ = trained(1, calculate_per_token_loss=True)
    assert per_token.steps[0]["train/pg_loss"] != pytest.approx(per_sample.steps[0]["train/pg_loss"], abs=1e-4)
    rpp, _ = trained(1, advantage_estimator="reinforce_plus_plus", kl_coef=0.01, normalize_advantages=True)
    assert rpp.steps[0]["train/ppo_kl"] == 0.0 and rpp.steps[1]["train/grad_norm"] > 0


@pytest.mark.parametrize("per_token", [False, True], ids=["per-sample", "per-token"])
def test_gspo_with_tis_and_opsm_two_ranks_match_one_rank(trained, tiny_qwen3_dir: Path, per_token: bool) -> None:
    """--advantage-estimator gspo: the sequence-level ratio's loss is normalised over the global batch too."""
    from safetensors.torch import load_file

    base = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
    flags = dict(advantage_estimator="gspo", use_tis=True, use_opsm=True, calculate_per_token_loss=per_token)
    one, two = trained(1, **flags), trained(2, **flags)
    assert_same_training(one, two, base)
    assert one[0].steps[0]["train/ppo_kl"] == 0.0 and "train/tis" in one[0].steps[0]
    assert one[1] != trained(1, calculate_per_token_loss=per_token)[1]  # not GRPO's update


def test_opd_whitened_over_two_ranks_matches_one_rank(trained, tiny_qwen3_dir: Path) -> None:
    """--use-opd with --normalize-advantages: the teacher's term enters the advantages before they are
    whitened over the whole rollout (both ranks), so two ranks train exactly as one."""
    from safetensors.torch import load_file

    base = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
    flags = dict(use_opd=True, opd_type="sglang", opd_kl_coef=0.5, normalize_advantages=True)
    one, two = trained(1, **flags), trained(2, **flags)
    assert_same_training(one, two, base)
    for a, b in zip(one[0].steps, two[0].steps):
        assert b["train/opd_reverse_kl"] == pytest.approx(a["train/opd_reverse_kl"], abs=1e-6)
    assert one[1] != trained(1, calculate_per_token_loss=False)[1]  # not GRPO's update


def test_miles_policy_loss_function_as_a_custom_loss_trains_as_the_built_in_loss(trained) -> None:
    built_in, built_in_bytes = trained(1, calculate_per_token_loss=False)
    custom, custom_bytes = trained(1, loss_type="custom_loss",
                                   custom_loss_function_path="miles.backends.megatron_utils.loss.policy_loss_function")
    for a, b in zip(built_in.steps, custom.steps):
        assert b["train/pg_loss"] == pytest.approx(a["train/pg_loss"], abs=1e-6)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-5)
    for name, raw in built_in_bytes.items():
        assert torch.allclose(torch.frombuffer(bytearray(custom_bytes[name]), dtype=torch.float32),
                              torch.frombuffer(bytearray(raw), dtype=torch.float32), atol=1e-6), name


def flat(state: dict) -> dict:
    """``model.<fqn>``, ``optimizer.state.<fqn>.<moment>``, ``optimizer.param_groups.<fqn>.<name>``."""
    return {f"{part}.{key}": value for part, entries in state.items() for key, value in entries.items()}


def test_a_save_of_two_ranks_resumes_on_one_exactly(pool, tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """2 ranks train a step and save; 1 rank loads that save: the same weights to the bit, the same
    optimizer state (a save right after the load holds exactly what was loaded), rank 0's RNG;
    and the next step trains on from Adam's moments as the two ranks do."""
    two_saved, one_saved = tmp_path / "two", tmp_path / "one"
    batch = samples()
    train = TrainConfig(lr=1e-2, global_batch_size=8, micro_batch_size=2, seed=0)
    with trainer_group(pool, 2, tiny_qwen3_dir, train) as two:
        two.train(batch)
        two.save(str(two_saved), with_hf=False)
        two_weights = two.tensor_bytes()
        two.train(batch)
        two_next = two.tensor_bytes()
    assert sorted(p.name for p in (two_saved / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    with trainer_group(pool, 1, tiny_qwen3_dir, train) as one:
        one.load(str(two_saved))
        assert one.tensor_bytes() == two_weights  # exact parameters
        one.save(str(one_saved), with_hf=False)
        one.train(batch)
        one_next = one.tensor_bytes()
    saved, resaved = (flat(read_state(path)) for path in (two_saved, one_saved))
    assert any(key.startswith("optimizer.state.") and key.endswith(".exp_avg_sq") for key in saved)
    assert {v.item() for k, v in saved.items() if k.endswith(".step")} == {1.0}
    assert_same_state(saved, resaved)  # model and every optimizer entry, unchanged through 2 -> 1 ranks
    assert torch.equal(torch.load(two_saved / "rng" / "rank0.pt"), torch.load(one_saved / "rng" / "rank0.pt"))
    like = {name: torch.frombuffer(bytearray(raw), dtype=torch.float32) for name, raw in two_next.items()}
    for name, raw in one_next.items():  # the second step: one rank on the whole batch = two ranks on halves
        assert torch.allclose(torch.frombuffer(bytearray(raw), dtype=torch.float32), like[name], atol=1e-5), name
