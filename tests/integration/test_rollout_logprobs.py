"""``--use-rollout-logprobs`` (miles' meaning): the engines' logprobs, not the trainer's recomputed
ones, are the PPO ratio's denominator. One rank of the fsdp backend on CPU, samples whose recorded
rollout logprobs are not the policy's: the first step is on-policy without the flag (ppo_kl 0)
and off-policy with it. ``--skip-actor-forward-only`` (the ratio's denominator is then the training
pass's own logprobs, or the engines' with the flag above) and ``--reset-optimizer-states`` on the
same backend."""

from __future__ import annotations

import pytest
import torch

from miles_disagg.config.components import TrainConfig
from miles_disagg.samples import Sample

pytestmark = pytest.mark.timeout(180)


def samples() -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    return [Sample(prompt_ids=torch.randint(3, 60, (4,), generator=generator).tolist(),
                   response_ids=torch.randint(3, 60, (5,), generator=generator).tolist(),
                   response_logprobs=[-0.5] * 5, advantage=float(i % 2) - 0.5) for i in range(4)]


@pytest.mark.parametrize("use_rollout_logprobs", [False, True])
def test_the_ratio_denominator(tiny_qwen3_dir, use_rollout_logprobs: bool) -> None:
    from miles_disagg.trainer.fsdp import FSDPBackend

    config = TrainConfig(train_backend="fsdp", lr=1e-3, global_batch_size=4, micro_batch_size=2,
                         use_rollout_logprobs=use_rollout_logprobs)
    metrics = FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1).train([samples()]).summary()
    first = metrics["train/ppo_kl_first_step"]
    if use_rollout_logprobs:
        assert abs(first) > 1e-3 and metrics["train/pg_clipfrac"] > 0  # -0.5 is far from the random model's logprobs
    else:
        assert first == pytest.approx(0.0, abs=1e-7)
    # the behaviour logprobs against the engines': the engines' own with the flag, so 0 (as miles reports)
    diff = metrics["train/train_rollout_logprob_abs_diff"]
    assert diff == 0.0 if use_rollout_logprobs else diff > 0.5


@pytest.mark.parametrize("use_rollout_logprobs", [False, True])
def test_skipping_the_forward_only_pass(tiny_qwen3_dir, use_rollout_logprobs: bool) -> None:
    from miles_disagg.trainer.fsdp import FSDPBackend

    config = TrainConfig(train_backend="fsdp", lr=1e-3, global_batch_size=4, micro_batch_size=2,
                         advantage_estimator="gspo", skip_actor_forward_only=True,
                         use_rollout_logprobs=use_rollout_logprobs)
    backend = FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)
    forwards = []
    backend.module.register_forward_hook(lambda *args: forwards.append(1))
    metrics = backend.train([samples()]).summary()
    assert len(forwards) == 2  # the two training micro-batches only: no frozen pass
    if use_rollout_logprobs:  # the engines' logprobs are the denominator
        assert abs(metrics["train/ppo_kl_first_step"]) > 1e-3
        assert metrics["train/train_rollout_logprob_abs_diff"] == 0.0
    else:  # the training pass's own, detached: the ratio is exactly 1; the mismatch is measured in the step
        assert metrics["train/ppo_kl_first_step"] == 0.0 and metrics["train/pg_clipfrac"] == 0.0
        assert metrics["train/train_rollout_logprob_abs_diff"] > 0.5


def test_reset_optimizer_states_after_the_rollout(tiny_qwen3_dir) -> None:
    from miles_disagg.config.actors import TrainerGroupConfig
    from miles_disagg.config.components import WeightUpdateConfig
    from miles_disagg.trainer.actor import TrainerRank
    from miles_disagg.trainer.fsdp import FSDPBackend

    config = TrainConfig(train_backend="fsdp", lr=1e-3, global_batch_size=4, micro_batch_size=2,
                         reset_optimizer_states=True)
    rank = TrainerRank(0, 1, TrainerGroupConfig(train=config, weights=WeightUpdateConfig(), hf_dir=str(tiny_qwen3_dir)))
    rank.backend = FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)
    result = rank.train([samples()])
    assert result.steps[0]["train/grad_norm"] > 0
    states = list(rank.backend.optimizer.state.values())
    assert states and all(float(state["step"]) == 0 and state["exp_avg"].abs().sum() == 0
                          and state["exp_avg_sq"].abs().sum() == 0 for state in states)
