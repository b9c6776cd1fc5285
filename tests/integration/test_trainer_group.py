"""The trainer group on real Ray (logical GPUs, gloo): data parallelism is exact, export is canonical,
and a checkpoint written by two ranks resumes on one.

Two ranks training on a global batch must end with the weights one rank gets from the same
batch (gradients are averaged over ranks; every sample here has the same number of response
tokens, so the per-rank token means average to the global one).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from checkpoint_reading import assert_same_state, read_state

from miles_disagg.config.components import ClusterConfig, TrainConfig, WeightUpdateConfig
from miles_disagg.types import Sample

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING")
    yield
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)


def samples(n: int = 8) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (4,), generator=generator).tolist()
        response = torch.randint(3, 60, (5,), generator=generator).tolist()
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-4.0] * 5,
                          advantage=float(i % 2) - 0.5))
    return out


@contextmanager
def trainer_group(world_size: int, model_dir: Path):
    """A set-up fsdp TrainerGroup of ``world_size`` ranks (shut down, bundles freed, on exit)."""
    from ray.util.placement_group import remove_placement_group

    from miles_disagg.config.actors import TrainerGroupConfig
    from miles_disagg.trainer.group import TrainerGroup
    from miles_disagg.trainer.placement import create_placement, plan_layout

    placement = create_placement(plan_layout(ClusterConfig(actor_num_gpus_per_node=world_size), external_rollout=True))
    train = TrainConfig(lr=1e-2, global_batch_size=8, micro_batch_size=2, seed=0)
    group = TrainerGroup(placement, TrainerGroupConfig(train=train, weights=WeightUpdateConfig(), hf_dir=str(model_dir)))
    try:
        info = group.setup()
        assert info["backend"] == "gloo"
        yield group
    finally:
        group.shutdown()
        remove_placement_group(placement.group)


def train_with(world_size: int, model_dir: Path) -> tuple[dict[str, float], dict[str, bytes]]:
    with trainer_group(world_size, model_dir) as group:
        metrics = group.train(samples())
        return metrics, group.tensor_bytes()


def test_two_ranks_match_one_rank_and_export_hf_names(ray_cluster, tiny_qwen3_dir: Path) -> None:
    from safetensors import safe_open

    one_metrics, one = train_with(1, tiny_qwen3_dir)
    two_metrics, two = train_with(2, tiny_qwen3_dir)
    with safe_open(str(next(tiny_qwen3_dir.glob("*.safetensors"))), "pt") as f:
        names = set(f.keys())
        base = {n: f.get_tensor(n) for n in names}
    assert set(one) == set(two) == names  # canonical HF names, nothing more, nothing less
    changed = 0
    for name in names:
        a = torch.frombuffer(bytearray(one[name]), dtype=base[name].dtype).view(base[name].shape)
        b = torch.frombuffer(bytearray(two[name]), dtype=base[name].dtype).view(base[name].shape)
        assert torch.allclose(a, b, atol=1e-5), name
        changed += not torch.equal(a, base[name])
    assert changed > len(names) // 2  # the step really moved the policy
    assert one_metrics["train/pg_loss"] == pytest.approx(two_metrics["train/pg_loss"], abs=1e-5)
    assert one_metrics["train/train_rollout_logprob_abs_diff"] > 0  # -4.0 is not what the model says


def flat(state: dict) -> dict:
    """``model.<fqn>``, ``optimizer.state.<fqn>.<moment>``, ``optimizer.param_groups.<fqn>.<name>``."""
    return {f"{part}.{key}": value for part, entries in state.items() for key, value in entries.items()}


def test_a_save_of_two_ranks_resumes_on_one_exactly(ray_cluster, tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """2 ranks train a step and save; 1 rank loads that save: the same weights to the bit, the same
    optimizer state (a save right after the load holds exactly what was loaded), rank 0's RNG;
    and the next step trains on from Adam's moments as the two ranks do."""
    two_saved, one_saved = tmp_path / "two", tmp_path / "one"
    batch = samples()
    with trainer_group(2, tiny_qwen3_dir) as two:
        two.train(batch)
        two.save(str(two_saved), with_hf=False)
        two_weights = two.tensor_bytes()
        two.train(batch)
        two_next = two.tensor_bytes()
    assert sorted(p.name for p in (two_saved / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]
    with trainer_group(1, tiny_qwen3_dir) as one:
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
