"""Sharded publication with ranks as threads: the split by size, one commit of every share, and
a failing rank (or hook) leaving no version, no debris and every snapshot as it was."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from miles_disagg.types import LayoutMismatch, VersionRef
from miles_disagg.weights.commit import ShareFailed
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.shares import assign_by_size
from miles_disagg.weights.store import STAGING_PREFIX, TRASH_PREFIX, VersionStore
from weights_fixtures import write_checkpoint


class ThreadRanks:
    """``world_size`` ranks in one process, each a thread (the ``Collective`` protocol)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self._barrier = threading.Barrier(world_size)
        self._slots: list[Any] = [None] * world_size

    def rank_view(self, rank: int) -> "RankView":
        return RankView(self, rank)


class RankView:
    def __init__(self, ranks: ThreadRanks, rank: int):
        self.ranks, self.rank, self.world_size = ranks, rank, ranks.world_size

    def broadcast(self, obj: Any) -> Any:
        if self.rank == 0:
            self.ranks._slots[0] = obj
        self.ranks._barrier.wait(timeout=60)
        value = self.ranks._slots[0]
        self.ranks._barrier.wait(timeout=60)
        return value

    def gather(self, obj: Any) -> list[Any] | None:
        self.ranks._slots[self.rank] = obj
        self.ranks._barrier.wait(timeout=60)
        out = list(self.ranks._slots) if self.rank == 0 else None
        self.ranks._barrier.wait(timeout=60)
        return out


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.w": (torch.randn(16 * (i + 1), 32, generator=g) * 0.02).bfloat16() for i in range(6)}


def trained(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (t.float() + 1e-2).to(t.dtype) for n, t in tensors.items()}


def run_ranks(world: int, fn: Callable[[int, RankView], Any]) -> list[Any]:
    """``fn(rank, collective)`` on every rank; each rank's return value or raised exception."""
    ranks = ThreadRanks(world)

    def call(rank: int) -> Any:
        try:
            return fn(rank, ranks.rank_view(rank))
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(world) as pool:
        return list(pool.map(call, range(world)))


def sharded_publishers(store: Path, base: Path, world: int, **kwargs) -> list[DeltaPublisher]:
    sizes = {n: t.numel() * t.element_size() for n, t in model().items()}
    shares = assign_by_size(sizes, world)

    def make(rank: int, collective: RankView) -> DeltaPublisher:
        pub = DeltaPublisher(store, base_dir=base, run_id="r", share=shares[rank], collective=collective, **kwargs)
        pub.capture_baseline()
        return pub

    made = run_ranks(world, make)
    assert all(isinstance(pub, DeltaPublisher) for pub in made), made
    return made


def publish_all(publishers: list[DeltaPublisher], tensors_of: Callable[[int], dict[str, torch.Tensor]]) -> list[Any]:
    ranks = ThreadRanks(len(publishers))
    for rank, pub in enumerate(publishers):
        pub.collective = ranks.rank_view(rank)

    def call(rank: int) -> Any:
        try:
            return publishers[rank].publish(tensors_of(rank).items())
        except Exception as exc:
            return exc

    with ThreadPoolExecutor(len(publishers)) as pool:
        return list(pool.map(call, range(len(publishers))))


def no_debris(store: Path) -> bool:
    return not [p for p in store.iterdir() if p.name.startswith((STAGING_PREFIX, TRASH_PREFIX))]


def test_assign_by_size_partitions_deterministically_and_balances() -> None:
    sizes = {f"t{i}": (i * 7919) % 1000 + 1 for i in range(50)}
    shares = assign_by_size(sizes, 4)
    assert shares == assign_by_size(dict(reversed(list(sizes.items()))), 4)
    assert set().union(*shares) == set(sizes) and sum(len(s) for s in shares) == len(sizes)
    totals = [sum(sizes[n] for n in s) for s in shares]
    assert max(totals) - min(totals) <= max(sizes.values())
    assert assign_by_size({"a": 5}, 3) == [frozenset({"a"}), frozenset(), frozenset()]
    with pytest.raises(ValueError):
        assign_by_size(sizes, 0)


def test_three_ranks_commit_one_version_equal_to_one_rank(tmp_path: Path) -> None:
    base = write_checkpoint(tmp_path / "base", model())
    calls: list[int] = []
    pubs = sharded_publishers(tmp_path / "store", base, 3, post_write_hook=lambda d, ref: calls.append(ref.version))
    assert max(p.snapshot_bytes for p in pubs) < sum(p.snapshot_bytes for p in pubs)  # each holds its share
    results = publish_all(pubs, lambda rank: trained(model()))
    assert results[1] is None and results[2] is None and results[0].ref == VersionRef("r", 1), results
    assert results[0].num_ranks == 3 and calls == [1]  # the hook ran once
    assert results[0].snapshot_bytes == max(p.snapshot_bytes for p in pubs)
    assert len(VersionStore(tmp_path / "store").read_index(1).files()) == 3 and no_debris(tmp_path / "store")
    single = DeltaPublisher(tmp_path / "one", base_dir=base, run_id="r")
    single.capture_baseline()
    single.publish(trained(model()).items())
    sharded = Materializer(tmp_path / "h1", base_dir=base).prepare(tmp_path / "store").path
    alone = Materializer(tmp_path / "h2", base_dir=base).prepare(tmp_path / "one").path
    assert (sharded / "model.safetensors").read_bytes() == (alone / "model.safetensors").read_bytes()
    merged: dict[str, str] = {}
    for pub in pubs:
        merged.update(pub.published_checksums())
    assert merged == single.published_checksums()


def test_a_failing_rank_leaves_no_version_and_the_next_publish_works(tmp_path: Path) -> None:
    base = write_checkpoint(tmp_path / "base", model())
    store = tmp_path / "store"
    pubs = sharded_publishers(store, base, 3)
    before = [p.published_checksums() for p in pubs]
    bad = {n: t[:1] for n, t in trained(model()).items()}  # wrong shapes: rank 2 cannot encode
    results = publish_all(pubs, lambda rank: bad if rank == 2 else trained(model()))
    assert isinstance(results[2], LayoutMismatch)
    assert isinstance(results[0], ShareFailed) and isinstance(results[1], ShareFailed), results
    assert "rank 2" in str(results[0])
    assert VersionStore(store).latest() is None and no_debris(store)
    assert [p.published_checksums() for p in pubs] == before and all(p.latest is None for p in pubs)
    results = publish_all(pubs, lambda rank: trained(model()))
    assert results[0].ref.version == 1 and VersionStore(store).latest().version == 1 and no_debris(store)


def test_a_failing_hook_fails_every_rank_and_changes_nothing(tmp_path: Path) -> None:
    base = write_checkpoint(tmp_path / "base", model())
    store = tmp_path / "store"
    fail = [True]

    def hook(version_dir: str, ref: VersionRef) -> None:
        if fail[0]:
            raise RuntimeError("the hook refused")

    pubs = sharded_publishers(store, base, 2, post_write_hook=hook)
    results = publish_all(pubs, lambda rank: trained(model()))
    assert isinstance(results[0], RuntimeError) and isinstance(results[1], ShareFailed), results
    assert "the hook refused" in str(results[1])
    assert VersionStore(store).latest() is None and no_debris(store) and not (store / "weight_v000001").exists()
    fail[0] = False
    assert publish_all(pubs, lambda rank: trained(model()))[0].ref.version == 1


def test_a_store_of_another_run_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 checks the store; the other ranks learn its verdict instead of waiting for it."""
    base = write_checkpoint(tmp_path / "base", model())
    store = tmp_path / "store"
    other = DeltaPublisher(store, base_dir=base, run_id="other")
    other.capture_baseline()
    other.publish(trained(model()).items())

    def make(rank: int, collective: RankView) -> DeltaPublisher:
        pub = DeltaPublisher(store, base_dir=base, run_id="r", share=None, collective=collective)
        pub.capture_baseline()
        return pub

    from miles_disagg.types import ConfigError

    results = run_ranks(2, make)
    assert isinstance(results[0], ConfigError) and isinstance(results[1], ShareFailed), results
    assert "holds run 'other'" in str(results[1])
