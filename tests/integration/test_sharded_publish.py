"""Sharded publication with process ranks (torch.distributed over gloo, as trainer ranks are):
1, 2 and 4 ranks publish the same trained weights; each writes its share, one version commits
with one index, and hosts apply it (in files, in RAM, through ``weights apply``) to the same bytes.

The trainer group's own paths (FSDP, Megatron TP=2 and EP=2, a rank killed mid-publish) are in
``test_sharded_publish_ranks.py``.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

from miles_disagg.bench.publish import publish_with_ranks, write_checkpoints
from miles_disagg.weights.checksums import checksum
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes
from miles_disagg.weights.store import STAGING_PREFIX, VersionStore

pytestmark = pytest.mark.timeout(600)


def state_checksums(directory: Path) -> dict[str, str]:
    return {name: checksum("xxh3-128", read_bytes(directory / f, e)) for name, (f, e) in checkpoint_tensors(directory).items()}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple[Path, Path]:
    return write_checkpoints(tmp_path_factory.mktemp("model"), size_mb=4, lr=1e-4, seed=0)


@pytest.fixture(scope="module")
def published(model, tmp_path_factory) -> dict[int, tuple[Path, dict]]:
    base, trained = model
    root = tmp_path_factory.mktemp("stores")
    return {ranks: (root / f"store-{ranks}", publish_with_ranks(base, trained, root / f"store-{ranks}", ranks))
            for ranks in (1, 2, 4)}


def test_every_rank_writes_its_share_and_one_version_commits(published, model) -> None:
    base, _ = model
    model_bytes = sum(e.nbytes for _, e in checkpoint_tensors(base).values())
    for ranks, (store_dir, report) in published.items():
        store = VersionStore(store_dir)
        assert store.visible_versions() == [1] and store.latest().version == 1
        index = store.read_index(1)
        files = index.files()
        assert files == [f"model-{i:05d}-of-{ranks:05d}.safetensors" for i in range(ranks)], files  # one per rank
        per_file = [sum(1 for f in index.weight_map.values() if f == name) for name in files]
        assert all(count > 0 for count in per_file), per_file  # every rank wrote payload
        assert not [p for p in store_dir.iterdir() if p.name.startswith(STAGING_PREFIX)]
        assert sorted(report["rank_snapshot_bytes"], reverse=True)[0] == report["max_snapshot_bytes"]
        assert sum(report["rank_snapshot_bytes"]) == model_bytes  # the shares partition the model
        assert report["max_snapshot_bytes"] <= 1.1 * model_bytes / ranks, (ranks, report["rank_snapshot_bytes"])
    one = published[1][1]["wire_bytes"]
    for ranks, (_, report) in published.items():
        assert abs(report["wire_bytes"] - one) <= 0.01 * one, (ranks, report["wire_bytes"], one)


def test_versions_of_1_2_and_4_ranks_apply_to_the_same_bytes(published, model, tmp_path) -> None:
    """On a host (A/B slots), in RAM (an engine's in-place update) and through ``weights apply``."""
    import torch

    from miles_disagg.weights.torch_bytes import dtype_from_code
    from miles_disagg.types import VersionRef

    base, trained = model
    expected = state_checksums(trained)
    for ranks, (store_dir, _) in published.items():
        host = Materializer(tmp_path / f"host-{ranks}", base_dir=base)
        prepared = host.prepare(store_dir)
        assert state_checksums(prepared.path) == expected, ranks
        held = {n: torch.frombuffer(read_bytes(base / f, e), dtype=dtype_from_code(e.dtype)).view(e.shape)
                for n, (f, e) in checkpoint_tensors(base).items()}
        run_id = VersionStore(store_dir).latest().run_id
        changed = host.prepare_in_memory(store_dir, 1, held, VersionRef(run_id, 0))
        in_ram = {**held, **changed}
        assert {n: checksum("xxh3-128", t.contiguous().view(torch.uint8).numpy()) for n, t in in_ram.items()} == expected
        host.close()
        local = tmp_path / f"cli-{ranks}"
        result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", "apply", "--store", str(store_dir),
                                 "--base-dir", str(base), "--local-dir", str(local)],
                                capture_output=True, text=True, timeout=scaled(300))
        assert result.returncode == 0, result.stderr[-2000:]
        assert json.loads(result.stdout)["version"] == 1
        assert state_checksums(local) == expected, ranks
        verify = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", "verify", "--store",
                                 str(store_dir), "--base-dir", str(base)], capture_output=True, text=True, timeout=scaled(300))
        assert verify.returncode == 0, verify.stderr[-2000:]


def _reference_applier():
    """The plain-format applier of the interop tests (written from the format, not from this codebase)."""
    path = Path(__file__).resolve().parents[1] / "unit" / "test_weights_interop.py"
    spec = importlib.util.spec_from_file_location("interop_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.apply_like_sglang


def test_a_plain_version_of_4_ranks_is_read_by_a_reference_only_consumer(tmp_path) -> None:
    """``filter none`` (what ``auto`` picks for foreign consumers): four rank files, one index,
    applied by a consumer that knows only the plain format."""
    import shutil

    from miles_disagg.weights.safetensors_io import write_file

    base, trained = write_checkpoints(tmp_path / "model", size_mb=2, lr=1e-4, seed=1, files=1)
    store = tmp_path / "store"
    publish_with_ranks(base, trained, store, 4, filter="none")
    index = json.loads((store / "weight_v000001" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["filter"] == "none" and len(set(index["weight_map"].values())) == 4
    local = tmp_path / "plain-host"
    local.mkdir()
    entries = checkpoint_tensors(base)
    write_file(local / "model.safetensors", {n: (e.dtype, e.shape, read_bytes(base / f, e))
                                             for n, (f, e) in entries.items()})
    _reference_applier()(local, store / "weight_v000001")
    assert state_checksums(local) == state_checksums(trained)
    shutil.rmtree(local)


def test_an_engine_serves_versions_of_1_and_4_ranks_identically(tiny_qwen3_dir: Path, tmp_path: Path) -> None:
    """The built-in engine pulls (verifying every tensor's checksum) and activates the version of a
    1-rank and of a 4-rank publish of the same trained weights: the live weights are the same."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from engine_fixtures import start_engine, stop_engine

    trained = tmp_path / "trained"
    shutil.copytree(tiny_qwen3_dir, trained)
    generator = torch.Generator().manual_seed(5)
    for file in trained.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({n: t + 0.01 * torch.randn(t.shape, generator=generator, dtype=t.dtype) for n, t in tensors.items()},
                  str(file), metadata={"format": "pt"})
    served = {}
    for ranks in (1, 4):
        store, local = tmp_path / f"store-{ranks}", tmp_path / f"local-{ranks}" / "ckpt"
        publish_with_ranks(tiny_qwen3_dir, trained, store, ranks)
        local.parent.mkdir(parents=True)
        engine = start_engine(tiny_qwen3_dir, tmp_path / f"engine-{ranks}", "--weight-store-dir", str(store),
                              "--local-checkpoint-dir", str(local))
        try:
            pulled = engine.post("/pull_weights", {"target_version": 1, "source_dir": str(store),
                                                   "local_checkpoint_dir": str(local)})
            assert pulled.status_code == 200 and pulled.json()["success"] is True, pulled.text
            activated = engine.post("/update_weights_from_disk", {"model_path": str(local), "weight_version": "1"})
            assert activated.status_code == 200, activated.text
            report = engine.get("/weight_checksums", params={"algorithm": "xxh3-128"}).json()
            assert report["weight_version"] == "1"
            served[ranks] = report["checksums"]
        finally:
            stop_engine(engine)
    assert served[1] == served[4] == state_checksums(trained)
