"""Interop with the plain disk-delta format other producers (miles, SGLang's /pull_weights) use.

The contract, as miles' publisher writes it and SGLang's ``weight_sync/local_checkpoint``
applies it: ``weight_vNNNNNN/model.safetensors.index.json`` with metadata ``version`` and
``base_version`` ("%06d" strings, read with ``int()``), ``delta_encoding`` (xor | overwrite),
``compression_format`` ("zstd"), ``checksum_format``; ``weight_map`` name -> payload file
``model-{i:05d}-of-{n:05d}.safetensors`` (one per writing rank); each payload is a 1-D U8
tensor under the HF tensor name holding ONE zstd frame (level 1, content size recorded, no
frame checksum) of ``old ^ new`` (xor) or ``[u32 count][u32 byte positions][new bytes]``
(overwrite); the file's ``__metadata__`` maps each name to the lowercase hex digest of the
tensor's full new bytes. No ``LATEST``; files are written ``.tmp`` + rename, index last.

Both directions are checked with readers/writers built here from safetensors, zstandard,
xxhash and blake3 directly, not through this project's codec.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from miles_disagg.types import ChecksumMismatch, FormatError, LayoutMismatch, LineageError, VersionRef
from miles_disagg.weights.audit import describe_store, verify_version
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.store import VersionStore
from weights_fixtures import fingerprint, write_checkpoint, write_foreign_version


def raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).reshape(-1).numpy().copy()


def digest(algorithm: str, data: np.ndarray) -> str:
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128(data).hexdigest()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3(data.tobytes()).hexdigest()
    return f"{zlib.adler32(data.tobytes()):08x}"


def atomic_write(path: Path, data: bytes) -> None:
    tmp = Path(str(path) + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def miles_version(store: Path, version: int, old: dict, new: dict, *, encoding: str = "xor",
                  checksum_format: str = "xxh3-128", ranks: int = 2) -> Path:
    """One version directory exactly as miles' disk-delta publisher lays it out (two writing ranks)."""
    return write_foreign_version(store, version, old, dict(sorted(new.items())), encoding=encoding,
                                 checksum_format=checksum_format, ranks=ranks)


def apply_like_sglang(local: Path, vdir: Path) -> None:
    """An independent applier of the plain format (what SGLang's /pull_weights checks and does)."""
    import safetensors
    import zstandard

    index = json.loads((vdir / "model.safetensors.index.json").read_text())
    meta = index["metadata"]
    assert meta["compression_format"] == "zstd" and meta["delta_encoding"] in ("xor", "overwrite")
    int(meta["version"]), int(meta["base_version"])
    from safetensors.torch import load_file, save_file

    held = load_file(str(local / "model.safetensors"))
    by_file: dict[str, set] = {}
    for name, fname in index["weight_map"].items():
        by_file.setdefault(fname, set()).add(name)
    for fname, names in by_file.items():
        with safetensors.safe_open(str(vdir / fname), framework="np") as f:
            assert set(f.keys()) == names
            checksums = f.metadata()
            for name in names:
                payload = f.get_tensor(name)
                assert payload.dtype == np.uint8 and payload.ndim == 1
                region = raw(held[name])
                frame = payload.tobytes()
                assert zstandard.get_frame_parameters(frame).content_size > 0  # decompress() needs it
                delta = np.frombuffer(zstandard.ZstdDecompressor().decompress(frame), dtype=np.uint8)
                if meta["delta_encoding"] == "xor":
                    assert delta.size == region.size
                    region ^= delta
                else:
                    count = int.from_bytes(delta[:4].tobytes(), "little")
                    positions = np.frombuffer(delta[4:4 + 4 * count].tobytes(), dtype="<u4")
                    region[positions] = delta[4 + 4 * count:]
                assert digest(meta["checksum_format"], region) == checksums[name], name
                held[name] = torch.from_numpy(region).view(held[name].dtype).reshape(held[name].shape)
    save_file(held, str(local / "model.safetensors"))


def tensors_at(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    t = {"model.embed_tokens.weight": (torch.randn(64, 16, generator=g) * 0.02).bfloat16(),
         "model.layers.0.mlp.down_proj.weight": (torch.randn(16, 48, generator=g) * 0.02).bfloat16(),
         "model.norm.weight": torch.ones(16), "lm_head.bias": torch.zeros(64, dtype=torch.float16)}
    for v in range(1, version + 1):
        if v == 3:
            continue  # version 3 changes nothing: an empty weight_map, no payload file
        for name in ("model.layers.0.mlp.down_proj.weight", "model.norm.weight" if v % 2 else "lm_head.bias"):
            t[name] = (t[name].float() + 1e-3 * torch.randn(t[name].shape, generator=g)).to(t[name].dtype)
    return t


FORMATS = {1: ("xor", "xxh3-128"), 2: ("overwrite", "blake3"), 3: ("xor", "adler32"), 4: ("xor", "xxh3-128")}


@pytest.fixture()
def miles_store(tmp_path: Path):
    base = write_checkpoint(tmp_path / "base", tensors_at(0))
    store = tmp_path / "miles"
    store.mkdir()
    for v, (encoding, algo) in FORMATS.items():
        miles_version(store, v, tensors_at(v - 1), tensors_at(v), encoding=encoding, checksum_format=algo)
    # a version still being written: payload .tmp, no index yet -> not visible
    (store / "weight_v000005").mkdir()
    (store / "weight_v000005" / "model-00000-of-00001.safetensors.tmp").write_bytes(b"partial")
    return base, store


def held(local: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(local / "model.safetensors"))


def assert_holds(local: Path, version: int) -> None:
    got, want = held(local), tensors_at(version)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


def test_a_store_written_by_miles_is_read_applied_and_verified(miles_store, tmp_path):
    base, store = miles_store
    s = VersionStore(store)
    assert s.latest() == VersionRef("", 4) and s.visible_versions() == [1, 2, 3, 4]
    index = s.read_index(2)
    assert index.foreign and (index.version, index.base_version, index.delta_encoding, index.filter) == (2, 1, "overwrite", "none")
    assert len(index.files()) == 2 and s.read_index(3).weight_map == {}
    host = Materializer(tmp_path / "local", base_dir=base)
    for target in (1, 3, 4):  # one step, a two-step catch-up across the empty version, one step
        prepared = host.prepare(store, target)
        assert prepared.ref == VersionRef("", target)
        assert_holds(tmp_path / "local", target)
    assert host.prepare(store).ref.version == 4  # latest = newest indexed dir; v5 is not visible
    fresh = Materializer(tmp_path / "fresh", base_dir=base)
    assert fresh.prepare(store).previous is None
    assert_holds(tmp_path / "fresh", 4)
    in_ram = fresh.prepare_in_memory(store, 4, tensors_at(1), VersionRef("", 1))
    assert in_ram and all(torch.equal(t, tensors_at(4)[n]) for n, t in in_ram.items())
    report = verify_version(s, None, base)
    assert report["chain"] == [1, 2, 3, 4] and report["final_checksums_verified"]
    summary = describe_store(s)
    assert summary["latest"] is None and [v["version"] for v in summary["versions"]] == [1, 2, 3, 4]
    assert all(v["foreign"] and "error" not in v for v in summary["versions"])


@pytest.mark.parametrize("case", ["flipped checksum", "wrong base", "wrong size", "xor twice", "checksum scope"])
def test_bad_miles_versions_fail_and_change_nothing(miles_store, tmp_path, case):
    base, store = miles_store
    host = Materializer(tmp_path / "local", base_dir=base)
    host.prepare(store, 1)
    vdir = store / "weight_v000002"
    if case == "flipped checksum":
        import safetensors.numpy

        fname = sorted(vdir.glob("*.safetensors"))[0]
        tensors = safetensors.numpy.load(fname.read_bytes())
        atomic_write(fname, safetensors.numpy.save(tensors, metadata={n: "0" * 64 for n in tensors}))
        error = ChecksumMismatch
    elif case == "wrong base":
        index = json.loads((vdir / "model.safetensors.index.json").read_text())
        index["metadata"]["base_version"] = "000000"
        atomic_write(vdir / "model.safetensors.index.json", json.dumps(index).encode())
        error = LineageError
    elif case == "wrong size":  # a delta produced against a differently shaped tensor
        for path in vdir.iterdir():
            path.unlink()
        vdir.rmdir()
        wider = {**tensors_at(2), "model.norm.weight": torch.ones(17)}
        miles_version(store, 2, {**tensors_at(1), "model.norm.weight": torch.zeros(17)}, wider, encoding="xor")
        error = LayoutMismatch
    elif case == "checksum scope":  # a fork's digests of the compressed payload, not of the final bytes
        index = json.loads((vdir / "model.safetensors.index.json").read_text())
        index["metadata"]["checksum_scope"] = "compressed_delta"
        atomic_write(vdir / "model.safetensors.index.json", json.dumps(index).encode())
        error = FormatError
    else:  # version 1 re-published as version 2: XOR would silently revert
        for path in vdir.iterdir():
            path.unlink()
        vdir.rmdir()
        miles_version(store, 2, tensors_at(0), tensors_at(1))
        error = ChecksumMismatch
    before = fingerprint(tmp_path / "local", store)
    with pytest.raises(error):
        host.prepare(store, 2)
    assert fingerprint(tmp_path / "local", store) == before
    assert_holds(tmp_path / "local", 1)


@pytest.mark.parametrize("encoding,checksum_format", [("xor", "xxh3-128"), ("overwrite", "adler32"), ("xor", "blake3")])
def test_filter_none_output_is_accepted_by_a_plain_format_applier(tmp_path, encoding, checksum_format):
    base = write_checkpoint(tmp_path / "base", tensors_at(0))
    store = tmp_path / "store"
    pub = DeltaPublisher(store, base_dir=base, run_id="r", encoding=encoding, checksum=checksum_format, filter="none")
    pub.capture_baseline()
    local = write_checkpoint(tmp_path / "plain-host", tensors_at(0))
    for v in (1, 2, 3):
        pub.publish(tensors_at(v).items())
        vdir = store / f"weight_v{v:06d}"
        index = json.loads((vdir / "model.safetensors.index.json").read_text())
        meta = index["metadata"]
        assert (meta["version"], meta["base_version"]) == (f"{v:06d}", f"{v - 1:06d}")
        assert (meta["delta_encoding"], meta["compression_format"], meta["checksum_format"]) == (encoding, "zstd", checksum_format)
        assert all(f.startswith("model-") and f.endswith(".safetensors") for f in index["weight_map"].values())
        apply_like_sglang(local, vdir)
        assert_holds(local, v)


def test_testing_helper_writes_the_same_layout(tmp_path):
    store = tmp_path / "s"
    vdir = write_foreign_version(store, 1, tensors_at(0), tensors_at(1), encoding="overwrite")
    local = write_checkpoint(tmp_path / "host", tensors_at(0))
    apply_like_sglang(local, vdir)
    assert_holds(local, 1)
    assert sorted(p.name for p in vdir.iterdir()) == ["model-00000-of-00001.safetensors", "model.safetensors.index.json"]


def test_a_store_whose_chain_has_a_gap_is_refused(miles_store, tmp_path):
    base, store = miles_store
    for path in (store / "weight_v000002").iterdir():
        path.unlink()
    (store / "weight_v000002").rmdir()
    host = Materializer(tmp_path / "local", base_dir=base)
    with pytest.raises((LineageError, FormatError)):
        host.prepare(store)
    assert host.held() is None


def test_a_restarted_miles_stream_is_followed_after_the_explicit_reset_to_version_0(miles_store, tmp_path):
    """miles wipes the store when a trainer starts and asks every host for version 0 first."""
    import shutil

    base, store = miles_store
    host = Materializer(tmp_path / "local", base_dir=base)
    assert host.prepare(store).ref == VersionRef("", 4)
    shutil.rmtree(store)
    store.mkdir()
    miles_version(store, 1, tensors_at(0), tensors_at(2))  # the new stream's first version
    before = fingerprint(tmp_path / "local", store)
    with pytest.raises(LineageError):  # never applied onto the old stream's version 4
        host.prepare(store, 1)
    assert fingerprint(tmp_path / "local", store) == before
    reset = host.prepare(store, 0)
    assert reset.ref == VersionRef("", 0) and reset.previous == VersionRef("", 4)
    assert_holds(tmp_path / "local", 0)
    assert host.prepare(store, 1).ref == VersionRef("", 1)
    assert_holds(tmp_path / "local", 2)  # the new stream's version 1 holds tensors_at(2)


def test_a_full_checkpoint_version_of_another_producer_is_refused_clearly(miles_store, tmp_path):
    """SGLang copies an ordinary checkpoint in ``weight_vN`` as a full version; this reader refuses it."""
    import shutil

    base, store = miles_store
    host = Materializer(tmp_path / "local", base_dir=base)
    host.prepare(store, 1)
    shutil.rmtree(store / "weight_v000002")
    write_checkpoint(store / "weight_v000002", tensors_at(2))
    (store / "weight_v000002" / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 1}, "weight_map": {n: "model.safetensors" for n in tensors_at(2)}}))
    before = fingerprint(tmp_path / "local", store)
    with pytest.raises(FormatError, match="full"):
        host.prepare(store, 4)
    assert fingerprint(tmp_path / "local", store) == before
