"""PPO's critic as its own trainer group on real Ray (gloo; the rank processes pooled for the
module: placing them in the critic's bundles is the PPO job's, tests/e2e/test_ppo_opd_job.py): two ranks train exactly as one (the value loss normalised over the global batch), and a
save written by two ranks loads into one with the same value head, values and lr schedule.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from ragged_batch import ragged_samples as samples

from miles_disagg.config.actors import CriticGroupConfig
from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.critic_values import values_of

pytestmark = pytest.mark.timeout(500)

LR, WARMUP = 0.05, 4


@pytest.fixture(scope="module")
def pool():
    """Critic rank processes on a private Ray, hosting every critic group of the module in turn."""
    from rank_pool import private_ray_pool

    with private_ray_pool("critic") as ranks:
        yield ranks


@contextmanager
def critic_group(pool, world_size: int, model_dir: Path):
    """A set-up CriticGroup of ``world_size`` of the pool's critic ranks (given back on exit)."""
    train = TrainConfig(train_backend="fsdp", global_batch_size=4, micro_batch_size=2, seed=0, clip_grad=0.0,
                        adam_eps=1.0, gamma=0.9, lambd=0.95)
    config = CriticGroupConfig(train=train, hf_dir=str(model_dir), lr=LR, lr_warmup_iters=WARMUP, value_clip=0.2)
    with pool.group(world_size, config) as group:
        assert group.setup_info["backend"] == "gloo"
        yield group


def run(pool, world_size: int, model_dir: Path, save_to: Path | None = None) -> dict:
    """Score 8 samples, train two steps on them, score again (and save)."""
    with critic_group(pool, world_size, model_dir) as group:
        batch = samples()
        group.score(batch)
        before = [values_of(s) for s in batch]
        result = group.train(batch).result()
        after = samples()
        group.score(after)
        if save_to is not None:
            group.save(str(save_to))
        return {"before": before, "after": [values_of(s) for s in after], "result": result,
                "head": group.value_head_state()}


@pytest.fixture(scope="module")
def runs(pool, tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    save = tmp_path_factory.mktemp("critic_save") / "iter"
    return {"one": run(pool, 1, tiny_qwen3_dir), "two": run(pool, 2, tiny_qwen3_dir, save_to=save), "save": save}


def test_two_ranks_train_the_critic_as_one(runs) -> None:
    one, two = runs["one"], runs["two"]
    for a, b in zip(one["before"], two["before"]):
        assert b == pytest.approx(a, abs=1e-6)  # the same value head (--seed) and model on every rank
    steps_one, steps_two = one["result"].steps, two["result"].steps
    assert len(steps_one) == len(steps_two) == 2  # 8 samples, global batch 4
    for a, b in zip(steps_one, steps_two):
        for key in ("critic/value_loss", "critic/value_clipfrac", "critic/lr"):
            assert b[key] == pytest.approx(a[key], abs=1e-6), key
        assert b["critic/grad_norm"] == pytest.approx(a["critic/grad_norm"], rel=1e-5)
    assert [s["critic/lr"] for s in steps_one] == pytest.approx([0.0, LR / WARMUP])  # Megatron's linear warmup
    for key in ("critic/explained_variance", "critic/values_mean", "critic/returns_mean"):
        assert two["result"].rollout[key] == pytest.approx(one["result"].rollout[key], abs=1e-6), key
    for name, tensor in one["head"].items():
        assert torch.allclose(tensor, two["head"][name], rtol=1e-4, atol=1e-7), name
    moved = [abs(x - y) for a, b in zip(one["before"], one["after"]) for x, y in zip(a, b)]
    assert max(moved) > 1e-3  # the second step (lr > 0) moved the values


def test_a_save_of_two_ranks_loads_into_one(pool, runs, tiny_qwen3_dir: Path) -> None:
    with critic_group(pool, 1, tiny_qwen3_dir) as group:
        group.load(str(runs["save"]))
        for name, tensor in runs["two"]["head"].items():
            assert torch.equal(group.value_head_state()[name], tensor), name
        again = samples()
        group.score(again)
        for a, b in zip(runs["two"]["after"], (values_of(s) for s in again)):
            assert b == pytest.approx(a, abs=1e-6)
        resumed = group.train(again).result()
        assert resumed.steps[0]["critic/lr"] == pytest.approx(2 * LR / WARMUP)  # the schedule's clock came back
