"""Host materialization: every bad input fails with a typed error and changes nothing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from miles_disagg.types import (
    ChecksumMismatch, FormatError, InvalidInput, LayoutMismatch, LineageError, VersionNotReady, VersionRef,
)
from miles_disagg.weights.format import INDEX_NAME
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.safetensors_io import read_header, write_file
from miles_disagg.weights.store import VersionStore
from weights_fixtures import fingerprint, write_checkpoint, write_foreign_version

NAMES = ("a.weight", "b.weight", "c.bias")


def tensors_at(version: int) -> dict[str, torch.Tensor]:
    """Deterministic weights of each version; each version changes a different subset."""
    g = torch.Generator().manual_seed(1)
    t = {"a.weight": torch.randn(40, 16, generator=g).bfloat16(), "b.weight": torch.randn(20, 8, generator=g),
         "c.bias": torch.randn(8, generator=g).half()}
    for v in range(1, version + 1):
        name = NAMES[v % 3]
        t[name] = (t[name].float() + 0.01 * torch.randn(t[name].shape, generator=g)).to(t[name].dtype)
        t["a.weight"] = (t["a.weight"].float() * (1 + 1e-2)).bfloat16()
    return t


@pytest.fixture()
def world(tmp_path: Path):
    """A base checkpoint, a store with versions 1..3, and a host holding version 2."""
    base = write_checkpoint(tmp_path / "base", tensors_at(0))
    store = tmp_path / "store"
    pub = DeltaPublisher(store, base_dir=base, run_id="run")
    pub.capture_baseline()
    for v in (1, 2, 3):
        pub.publish(tensors_at(v).items())
    host = Materializer(tmp_path / "local", base_dir=base)
    host.prepare(store, 2)
    return base, store, host, tmp_path / "local"


def held(local: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(local / "model.safetensors"))


def assert_holds(local: Path, version: int) -> None:
    got, want = held(local), tensors_at(version)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def edit_index(store: Path, version: int, fn) -> None:
    path = store / f"weight_v{version:06d}" / INDEX_NAME
    obj = json.loads(path.read_text())
    fn(obj)
    path.write_text(json.dumps(obj))


def payload_path(store: Path, version: int) -> Path:
    index = json.loads((store / f"weight_v{version:06d}" / INDEX_NAME).read_text())
    return store / f"weight_v{version:06d}" / sorted(set(index["weight_map"].values()))[0]


def flip_byte(path: Path, offset_from_end: int = 20) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def set_metadata(key, value):
    return lambda obj: obj["metadata"].__setitem__(key, value)


def wrong_checksum(store: Path) -> None:
    path = payload_path(store, 3)
    header = read_header(path)
    tensors = {n: (e.dtype, e.shape, path.read_bytes()[e.offset:e.offset + e.nbytes]) for n, e in header.tensors.items()}
    write_file(path, tensors, {n: "0" * 32 for n in header.metadata})


BAD_INPUTS = {
    "flipped payload byte": (lambda s: flip_byte(payload_path(s, 3)), (FormatError, ChecksumMismatch)),
    "wrong final checksum": (wrong_checksum, ChecksumMismatch),
    "truncated payload": (lambda s: payload_path(s, 3).write_bytes(payload_path(s, 3).read_bytes()[:-50]), FormatError),
    "truncated header": (lambda s: payload_path(s, 3).write_bytes(payload_path(s, 3).read_bytes()[:30]), FormatError),
    "missing payload": (lambda s: payload_path(s, 3).unlink(), FormatError),
    "wrong base version": (lambda s: edit_index(s, 3, set_metadata("base_version", "000001")), LineageError),
    "wrong run": (lambda s: edit_index(s, 3, set_metadata("run_id", "other-run")), LineageError),
    "unknown encoding": (lambda s: edit_index(s, 3, set_metadata("delta_encoding", "rle")), FormatError),
    "unknown compression": (lambda s: edit_index(s, 3, set_metadata("compression_format", "lz4")), FormatError),
    "unknown filter": (lambda s: edit_index(s, 3, set_metadata("filter", "bitshuffle")), FormatError),
    "unknown checksum": (lambda s: edit_index(s, 3, set_metadata("checksum_format", "md5")), FormatError),
    "dtype differs": (lambda s: edit_index(s, 3, lambda o: o["metadata"]["tensors"]["a.weight"].__setitem__("dtype", "F16")), LayoutMismatch),
    "shape differs": (lambda s: edit_index(s, 3, lambda o: o["metadata"]["tensors"]["a.weight"].__setitem__("shape", [16, 40])), LayoutMismatch),
    "size differs": (lambda s: edit_index(s, 3, lambda o: o["metadata"]["tensors"]["a.weight"].__setitem__("nbytes", 4)), LayoutMismatch),
    "unknown tensor": (lambda s: edit_index(s, 3, lambda o: o["weight_map"].__setitem__("zzz", next(iter(o["weight_map"].values())))), (LayoutMismatch, FormatError)),
    "weight_map leaves the directory": (lambda s: edit_index(s, 3, lambda o: o["weight_map"].__setitem__("a.weight", "../x.safetensors")), FormatError),
    "weight_map absolute path": (lambda s: edit_index(s, 3, lambda o: o["weight_map"].__setitem__("a.weight", "/etc/x.safetensors")), FormatError),
    "index not json": (lambda s: (s / "weight_v000003" / INDEX_NAME).write_text("{"), FormatError),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_clearly_and_changes_nothing(world, case):
    base, store, host, local = world
    corrupt, error = BAD_INPUTS[case]
    corrupt(store)
    before = fingerprint(local, store)
    with pytest.raises(error) as info:
        host.prepare(store, 3)
    assert str(info.value)  # a message, not an empty error
    assert fingerprint(local, store) == before
    assert host.held() == VersionRef("run", 2)
    assert_holds(local, 2)


def test_version_applied_twice_or_backwards_is_a_lineage_error(world):
    base, store, host, local = world
    before = fingerprint(local, store)
    again = host.prepare(store, 2)  # the held version: returned cheaply, nothing applied
    assert again.ref == again.previous == VersionRef("run", 2) and again.changed == ()
    with pytest.raises(LineageError, match="never applied twice"):
        host.prepare(store, 1)
    assert fingerprint(local, store) == before
    with pytest.raises(LineageError):  # applying version 2's delta onto an engine already at 2
        host.prepare_in_memory(store, 2, tensors_at(2), VersionRef("run", 3))


def test_unpublished_version_is_not_ready(world):
    base, store, host, local = world
    before = fingerprint(local, store)
    with pytest.raises(VersionNotReady, match="not published"):
        host.prepare(store, 9)
    assert fingerprint(local, store) == before


def test_prepare_switches_slots_and_reports_changes(world):
    base, store, host, local = world
    first_path = host.held_path()
    prepared = host.prepare(store, 3)
    assert prepared.ref == VersionRef("run", 3) and prepared.previous == VersionRef("run", 2)
    assert set(prepared.changed) == set(json.loads((store / "weight_v000003" / INDEX_NAME).read_text())["weight_map"])
    assert prepared.path != first_path and local.resolve() == prepared.path.resolve()
    assert (local / "config.json").exists()
    assert_holds(local, 3)
    assert_holds(first_path, 2)  # the previous slot was never written
    base_files = {p.name: p.read_bytes() for p in base.iterdir()}
    assert base_files == {p.name: p.read_bytes() for p in base.iterdir()}


def test_fresh_host_seeds_from_base(world):
    base, store, host, local = world
    fresh = Materializer(local.parent / "fresh", base_dir=base)
    assert fresh.held() is None
    prepared = fresh.prepare(store)
    assert prepared.previous is None and set(prepared.changed) == set(NAMES)
    assert_holds(local.parent / "fresh", 3)
    zero = Materializer(local.parent / "zero", base_dir=base).prepare(store, 0)
    assert zero.ref.version == 0
    assert_holds(local.parent / "zero", 0)


def test_prepare_in_memory_returns_verified_changed_tensors(world):
    base, store, host, local = world
    source = tensors_at(1)
    snapshot = {k: v.clone() for k, v in source.items()}
    changed = host.prepare_in_memory(store, 3, source, VersionRef("run", 1))
    assert set(changed) <= set(NAMES) and changed
    for name, tensor in changed.items():
        assert torch.equal(tensor, tensors_at(3)[name]) and tensor.dtype == source[name].dtype
    for name in source:  # inputs untouched
        assert torch.equal(source[name], snapshot[name])
    assert host.prepare_in_memory(store, 3, tensors_at(3), VersionRef("run", 3)) == {}


def test_foreign_plain_format_without_pointer_is_read(tmp_path):
    base = write_checkpoint(tmp_path / "base", tensors_at(0))
    store = tmp_path / "foreign"
    store.mkdir()
    write_foreign_version(store, 1, tensors_at(0), tensors_at(1))
    write_foreign_version(store, 2, tensors_at(1), tensors_at(2), encoding="overwrite", checksum_format="adler32")
    write_foreign_version(store, 3, tensors_at(2), tensors_at(3), checksum_format="blake3", ranks=2)
    assert VersionStore(store).latest() == VersionRef("", 3)
    host = Materializer(tmp_path / "local", base_dir=base)
    assert host.prepare(store, 2).ref.version == 2
    assert_holds(tmp_path / "local", 2)
    assert host.prepare(store).ref.version == 3
    assert_holds(tmp_path / "local", 3)
    # a publisher continues a foreign store; its versions become visible through LATEST
    pub = DeltaPublisher(store, base_dir=base)
    pub.capture_baseline()
    assert pub.publish(tensors_at(4).items()).ref.version == 4
    assert host.prepare(store).ref.version == 4
    assert_holds(tmp_path / "local", 4)


def test_pre_read_hook_runs_first_and_can_abort(world):
    base, store, host, local = world
    calls = []
    hooked = Materializer(local, base_dir=base,
                          pre_read_hook=lambda source_dir, target_version: calls.append((source_dir, target_version)))
    hooked.prepare(store, 3)
    assert calls == [(str(store), 3)]  # as SGLang calls it: once per pull, (source_dir, target_version)
    hooked.prepare(store, 0)  # an explicit reset to the base reads nothing from the store
    assert calls == [(str(store), 3)]

    def refuse(source_dir, target_version):
        raise OSError("object store unavailable")

    other = Materializer(local.parent / "other", base_dir=base, pre_read_hook=refuse)
    with pytest.raises(OSError):
        other.prepare(store, 3)
    assert other.held() is None


def test_local_dir_with_foreign_files_is_refused(tmp_path, world):
    base, store, host, local = world
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "model.safetensors").write_bytes(b"x")
    with pytest.raises(InvalidInput, match="not managed"):
        Materializer(occupied, base_dir=base).prepare(store)
    assert (occupied / "model.safetensors").read_bytes() == b"x"


def test_concurrent_prepares_serialize(world):
    base, store, host, local = world
    results, errors = [], []

    def run():
        try:
            results.append(host.prepare(store, 3).ref)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and results == [VersionRef("run", 3)] * 3
    assert_holds(local, 3)


def test_unchanged_shards_are_hard_linked_and_patched_shards_are_fresh_copies(tmp_path):
    from safetensors.torch import save_file

    base = tmp_path / "base"
    base.mkdir()
    first = {"a.weight": tensors_at(0)["a.weight"], "c.bias": tensors_at(0)["c.bias"]}
    save_file(first, str(base / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": tensors_at(0)["b.weight"]}, str(base / "model-00002-of-00002.safetensors"))
    (base / "config.json").write_text("{}")
    store = tmp_path / "store"
    pub = DeltaPublisher(store, base_dir=base, run_id="r")
    pub.capture_baseline()
    pub.publish({**tensors_at(0), "a.weight": tensors_at(1)["a.weight"]}.items())  # only shard 1 changes
    host = Materializer(tmp_path / "local", base_dir=base)
    slot = host.prepare(store).path
    unchanged, patched = "model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"
    assert (slot / unchanged).stat().st_ino == (base / unchanged).stat().st_ino
    assert (slot / patched).stat().st_ino != (base / patched).stat().st_ino
    assert (slot / "config.json").stat().st_ino != (base / "config.json").stat().st_ino
    from safetensors.torch import load_file

    assert torch.equal(load_file(str(base / patched))["a.weight"], tensors_at(0)["a.weight"])  # base untouched
    assert torch.equal(load_file(str(slot / patched))["a.weight"], tensors_at(1)["a.weight"])
