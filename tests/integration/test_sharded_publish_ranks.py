"""Sharded publication by the real trainer group (Ray actors, gloo, CPU): FSDP over 4 ranks (2 in the kill test),
Megatron TP=2 (2 ranks; 4 ranks: 2 data-parallel replicas) and EP=2 (Qwen3-MoE) each train a
step, then every rank writes its
share of the trained policy; one version commits with one index; a host applies it to the
bytes the trainer holds, and those bytes equal a 1-rank publish of the same weights.

A trainer rank killed in the middle of a publish (inside the post-write hook: every share
durable, the directory renamed, ``LATEST`` not yet moved): no new version is visible, ``weights
verify`` passes on LATEST, and the resumed run publishes the next version over the debris.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from deadlines import scaled
import torch

from miles_disagg.config.components import TrainConfig, WeightUpdateConfig
from miles_disagg.samples import Sample
from miles_disagg.types import VersionRef
from miles_disagg.weights.checksums import checksum
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes
from miles_disagg.weights.store import STAGING_PREFIX, TRASH_PREFIX, VersionStore

pytestmark = pytest.mark.timeout(600)

HOOK_MODULE = '''
import time
from pathlib import Path


def block_from_version_2(version_dir, ref):
    """Stands still inside the commit of version 2 (the test kills the committing rank here)."""
    if ref.version < 2:
        return
    (Path(version_dir).parent.parent / "hook-entered").write_text(str(ref.version))
    time.sleep(900)
'''


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Trainer rank processes on a private Ray (the kill hook on their path), hosting every group of the module."""
    from rank_pool import private_ray_pool

    hooks = tmp_path_factory.mktemp("hooks")
    (hooks / "sharded_kill_hook.py").write_text(HOOK_MODULE)
    saved = dict(os.environ)  # restored after: later tests in this process see the environment they expect
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p)
    try:
        with private_ray_pool() as ranks:
            yield ranks
    finally:
        os.environ.clear()
        os.environ.update(saved)


def samples(n: int = 8) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 20, (3 + i % 3,), generator=generator).tolist()
        response = torch.randint(3, 20, (4 + i % 2,), generator=generator).tolist()
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-3.0] * len(response),
                          advantage=float(i % 2) - 0.5 + 0.1 * i, loss_mask=[1] * len(response)))
    return out


def disk_delta(store: Path, **flags) -> WeightUpdateConfig:
    return WeightUpdateConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(store), **flags)


@contextmanager
def trainer_group(pool, model_dir: Path, world_size: int, weights: WeightUpdateConfig, run_id: str | None = None,
                  **train_flags):
    """A set-up TrainerGroup of ``world_size`` of the pool's ranks (given back on exit)."""
    from miles_disagg.config.actors import TrainerGroupConfig

    flags = {"lr": 1e-2, "global_batch_size": 8, "micro_batch_size": 2, "seed": 0, **train_flags}
    config = TrainerGroupConfig(train=TrainConfig(**flags), weights=weights, hf_dir=str(model_dir))
    with pool.group(world_size, config, run_id=run_id, delta_filter="byteplane") as group:
        yield group


def digests(raw: dict[str, bytes]) -> dict[str, str]:
    import numpy as np

    return {n: checksum("xxh3-128", np.frombuffer(b, dtype=np.uint8)) for n, b in raw.items()}


def held_digests(directory: Path) -> dict[str, str]:
    return {n: checksum("xxh3-128", read_bytes(directory / f, e)) for n, (f, e) in checkpoint_tensors(directory).items()}


def one_rank_publish(model_dir: Path, store: Path, policy: dict[str, bytes]) -> dict[str, str]:
    """The same weights published by one publisher alone, as a host applies them."""
    from miles_disagg.weights.publisher import DeltaPublisher
    from miles_disagg.weights.torch_bytes import dtype_from_code

    entries = checkpoint_tensors(model_dir)
    publisher = DeltaPublisher(store, base_dir=model_dir)
    publisher.capture_baseline()
    publisher.publish((n, torch.frombuffer(bytearray(policy[n]), dtype=dtype_from_code(e.dtype)).view(e.shape))
                      for n, (_, e) in entries.items())
    publisher.close()
    return held_digests(Materializer(store.parent / f"{store.name}-host", base_dir=model_dir).prepare(store).path)


CASES = {  # (model, ranks, flags)
    "fsdp-4-ranks": ("tiny_qwen3_dir", 4, {"train_backend": "fsdp"}),
    "megatron-tp2": ("tiny_qwen3_dir", 2, {"train_backend": "megatron", "tensor_model_parallel_size": 2}),
    "megatron-tp2-dp2": ("tiny_qwen3_dir", 4, {"train_backend": "megatron", "tensor_model_parallel_size": 2}),
    "megatron-ep2": ("tiny_moe_dir", 2, {"train_backend": "megatron", "expert_model_parallel_size": 2}),
}


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    from tiny_moe import make_tiny_moe

    return make_tiny_moe(tmp_path_factory.mktemp("tiny-moe") / "model")


@pytest.mark.parametrize("case", list(CASES))
def test_every_rank_writes_a_share_of_the_trained_policy(pool, case: str, request, tmp_path: Path) -> None:
    if case.startswith("megatron"):
        pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    fixture, ranks, flags = CASES[case]
    model_dir: Path = request.getfixturevalue(fixture)
    store = tmp_path / "store"
    with trainer_group(pool, model_dir, ranks, disk_delta(store), **flags) as group:
        group.train(samples())
        result = group.publish()
        policy = group.tensor_bytes()  # rank 0's whole export (the unsharded path) of the same weights
        expected = group.weight_checksums("xxh3-128")  # every rank's share, merged
    model_bytes = sum(e.nbytes for _, e in checkpoint_tensors(model_dir).values())
    assert result.ref.version == 1 and result.num_ranks == ranks, result
    assert result.metrics()["perf/update_weights_snapshot_bytes"] == result.snapshot_bytes < model_bytes
    index = VersionStore(store).read_index(1)
    assert index.files() == [f"model-{i:05d}-of-{ranks:05d}.safetensors" for i in range(ranks)]  # every rank wrote
    assert expected == digests(policy)  # the shares together are the whole policy
    host = Materializer(tmp_path / "host", base_dir=model_dir).prepare(store)
    assert held_digests(host.path) == expected
    assert one_rank_publish(model_dir, tmp_path / "one-rank", policy) == expected
    assert not [p for p in store.iterdir() if p.name.startswith((STAGING_PREFIX, TRASH_PREFIX))]


def wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout_s}s"
        time.sleep(0.2)


def verify_cli(store: Path, base: Path) -> dict:
    import json

    result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", "verify", "--store", str(store),
                             "--base-dir", str(base)], capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def test_a_rank_killed_mid_publish_leaves_no_version_and_the_resumed_run_publishes(
        pool, tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    import ray

    store = tmp_path / "store"
    blocking = disk_delta(store, custom_update_weight_post_write_path="sharded_kill_hook:block_from_version_2")
    with trainer_group(pool, tiny_qwen3_dir, 2, blocking, train_backend="fsdp") as group:
        group.train(samples())
        assert group.publish().ref.version == 1
        run_id = group.run_id
        group.train(samples())
        pending = [r.publish.remote() for r in group.ranks]
        wait_for_file(tmp_path / "hook-entered", 300)  # every share durable, the version not yet committed
        ray.kill(group.ranks[0])
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(pending[0], timeout=120)
        pool.discard(group.ranks)  # rank 1 stands still in the hook: the group's processes end here
    visible = VersionStore(store)
    assert visible.latest() == VersionRef(run_id, 1) and visible.visible_versions() == [1]
    assert len(visible.read_index(1).files()) == 2  # both ranks wrote a share of version 1
    assert verify_cli(store, tiny_qwen3_dir)["version"] == 1
    with trainer_group(pool, tiny_qwen3_dir, 2, disk_delta(store), run_id=run_id, train_backend="fsdp") as group:
        group.train(samples())
        assert group.publish().ref == VersionRef(run_id, 2)
        expected = group.weight_checksums("xxh3-128")
    assert visible.visible_versions() == [1, 2]
    assert not [p for p in store.iterdir() if p.name.startswith((STAGING_PREFIX, TRASH_PREFIX))]
    assert verify_cli(store, tiny_qwen3_dir)["version"] == 2
    assert held_digests(Materializer(tmp_path / "host", base_dir=tiny_qwen3_dir).prepare(store).path) == expected


def test_a_lora_adapter_version_published_over_two_ranks_is_the_one_rank_version(pool, tiny_qwen3_dir: Path,
                                                                                 tmp_path: Path) -> None:
    """LoRA (FSDP, 2 ranks, gloo): the adapter chain's version 0 is written once (rank 0), each rank
    writes its share of the adapter version, and a host holds the trainer's adapter byte for byte, the
    same bytes as one publisher alone makes of it; the base is never published."""
    from miles_disagg.config.actors import TrainerGroupConfig
    from miles_disagg.weights.adapters import check_adapter_dir

    store, base = tmp_path / "store", tmp_path / "store.lora-v0"
    config = TrainerGroupConfig(train=TrainConfig(lr=5e-2, global_batch_size=8, micro_batch_size=2, seed=0,
                                                  train_backend="fsdp", lora_rank=4, lora_alpha=8),
                                weights=disk_delta(store), hf_dir=str(tiny_qwen3_dir), lora_base_dir=str(base))
    with pool.group(2, config, run_id=None, delta_filter="none") as group:
        group.train(samples())
        result = group.publish()
        expected = group.weight_checksums("xxh3-128")  # the trainer's adapter, both shares merged
    assert result.ref.version == 1 and result.num_ranks == 2, result
    assert len(VersionStore(store).read_index(1).files()) == 2  # each rank wrote its share
    assert all(".lora_" in name for name in expected) and len(expected) == 2 * len(check_adapter_dir(base).modules)
    host = Materializer(tmp_path / "host", base_dir=base).prepare(store)
    held = {n: bytes(read_bytes(host.path / f, e)) for n, (f, e) in checkpoint_tensors(host.path).items()}
    assert held_digests(host.path) == expected and check_adapter_dir(host.path).rank == 4
    assert one_rank_publish(base, tmp_path / "one-rank", held) == expected
