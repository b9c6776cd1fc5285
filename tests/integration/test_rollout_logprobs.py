"""``--use-rollout-logprobs`` (miles' meaning): the engines' logprobs, not the trainer's recomputed
ones, are the PPO ratio's denominator. One rank of the fsdp backend on CPU, samples whose recorded
rollout logprobs are not the policy's: the first step is on-policy without the flag (ppo_kl 0)
and off-policy with it."""

from __future__ import annotations

import pytest
import torch

from miles_disagg.config.components import TrainConfig
from miles_disagg.types import Sample

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
    assert metrics["train/train_rollout_logprob_abs_diff"] > 0.5  # reported either way
