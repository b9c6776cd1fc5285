"""Two fsdp ranks (gloo data parallelism over Ray actors) train the tiny Qwen3-MoE with rollout
routing replay as one rank does on the whole batch: same metrics, same weights. An expert no token
on any rank was routed to keeps its bytes (it has no gradient anywhere, which data parallelism
must tolerate)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.config.components import TrainConfig, WeightUpdateConfig
from miles_disagg.samples import Sample

pytestmark = pytest.mark.timeout(400)
UNUSED_EXPERT = 3


@pytest.fixture(scope="module")
def pool():
    """Trainer rank processes on a private Ray: the 1-rank group's is rank 0 of the 2-rank group."""
    from rank_pool import private_ray_pool

    with private_ray_pool(num_gpus=2) as ranks:
        yield ranks


def samples(n: int = 8) -> list[Sample]:
    """Ragged samples whose routing (top 2 of experts 0-2, never 3) the trainer replays."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        prompt = rng.integers(3, 12, 3 + i % 3).tolist()
        response = rng.integers(3, 12, 4 + i % 2).tolist()
        routed = np.stack([rng.permutation(3)[:2] for _ in range((len(prompt) + len(response) - 1) * 2)])
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-2.0] * len(response),
                          advantage=float(i % 2) - 0.5 + 0.1 * i,
                          rollout_routed_experts=routed.reshape(-1, 2, 2).astype(np.int32)))
    return out


@contextmanager
def trainer_group(pool, model_dir: Path, world_size: int, **train_flags):
    """A set-up fsdp TrainerGroup of ``world_size`` of the pool's ranks (given back on exit)."""
    from miles_disagg.config.actors import TrainerGroupConfig

    train = TrainConfig(**{"lr": 1.0, "adam_eps": 1.0, "clip_grad": 0.0, "global_batch_size": 8,
                           "micro_batch_size": 2, "seed": 0, "train_backend": "fsdp", **train_flags})
    with pool.group(world_size, TrainerGroupConfig(train=train, weights=WeightUpdateConfig(),
                                                   hf_dir=str(model_dir))) as group:
        yield group


def trained(pool, model_dir: Path, world_size: int):
    with trainer_group(pool, model_dir, world_size, use_rollout_routing_replay=True) as group:
        before = group.tensor_bytes()
        result = group.train(samples())
        return before, result, group.tensor_bytes()


def test_two_ranks_train_the_moe_as_one_rank_does(pool, tiny_qwen3_moe_dir: Path) -> None:
    before, one, one_after = trained(pool, tiny_qwen3_moe_dir, 1)
    _, two, two_after = trained(pool, tiny_qwen3_moe_dir, 2)
    for a, b in zip(one.steps, two.steps):
        assert a["train/routing_replay_match"] == b["train/routing_replay_match"] == 1.0
        assert a["train/routing_agreement"] == pytest.approx(b["train/routing_agreement"])
        for key in ("train/pg_loss", "train/entropy"):
            assert a[key] == pytest.approx(b[key], abs=1e-5), key
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=1e-4)
    for name, raw in before.items():
        one_w, two_w = (torch.frombuffer(bytearray(w[name]), dtype=torch.float32) for w in (one_after, two_after))
        if f".experts.{UNUSED_EXPERT}." in name:
            assert one_after[name] == two_after[name] == raw, name
        else:
            assert one_after[name] != raw, name
            assert torch.allclose(one_w, two_w, rtol=1e-3, atol=1e-6), name
