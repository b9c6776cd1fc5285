"""The trainer group on real Ray (logical GPUs, gloo): data parallelism is exact, export is canonical.

Two ranks training on a global batch must end with the weights one rank gets from the same
batch (gradients are averaged over ranks; every sample here has the same number of response
tokens, so the per-rank token means average to the global one).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

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


def train_with(world_size: int, model_dir: Path) -> tuple[dict[str, float], dict[str, bytes]]:
    from miles_disagg.config.actors import TrainerGroupConfig
    from miles_disagg.trainer.group import TrainerGroup
    from miles_disagg.trainer.placement import create_placement, plan_layout

    placement = create_placement(plan_layout(ClusterConfig(actor_num_gpus_per_node=world_size), external_rollout=True))
    train = TrainConfig(train_backend="fsdp", lr=1e-2, global_batch_size=8, micro_batch_size=2, seed=0)
    group = TrainerGroup(placement, TrainerGroupConfig(train=train, weights=WeightUpdateConfig(), hf_dir=str(model_dir)))
    try:
        info = group.setup()
        assert info["backend"] == "gloo"
        metrics = group.train(samples())
        return metrics, group.tensor_bytes()
    finally:
        group.shutdown()
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(placement.group)


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
