"""The ``mixed`` encoding: per tensor the smallest of XOR byte planes, sparse and overwrite.

Round trips at every density and dtype size, the choice made per tensor and recorded in the index,
readers that do not know ``mixed`` refusing it, and malformed sparse payloads refused before
anything is written.
"""

from __future__ import annotations

import json
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_disagg.types import FormatError
from miles_disagg.weights.audit import verify_version
from miles_disagg.weights.codec import decode_tensors, encode_tensors, publish_spec
from miles_disagg.weights.format import CodecSpec
from miles_disagg.weights.format import INDEX_NAME, TensorLayout, VersionIndex, parse_index
from miles_disagg.weights.materializer import Materializer
from miles_disagg.weights.publisher import DeltaPublisher
from miles_disagg.weights.sparse import parse_sparse, sparse_raw
from miles_disagg.weights.store import VersionStore
from weights_fixtures import write_checkpoint

POOL = ThreadPoolExecutor(2)
MIXED = CodecSpec("mixed", "byteplane", 4096)


def bf16_step(numel: int, density: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """bf16-like bytes where about ``density`` of the elements changed in their low bits."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 2**16, numel, dtype=np.uint16)
    new = old.copy()
    mask = rng.random(numel) < density
    new[mask] ^= rng.integers(1, 8, int(mask.sum()), dtype=np.uint16)
    return old.view(np.uint8), new.view(np.uint8)


def roundtrip(spec: CodecSpec, old: np.ndarray, new: np.ndarray, itemsize: int):
    [enc] = list(encode_tensors(POOL, spec, "xxh3-128", [("t", old, new, itemsize)]))
    target = old.copy()
    if enc.payload is not None:
        list(decode_tensors(POOL, spec, "xxh3-128", [("t", target, memoryview(enc.payload), itemsize, enc.checksum)],
                            encodings={"t": enc.encoding}))
    return enc, target


@settings(max_examples=60, deadline=None)
@given(itemsize=st.sampled_from([1, 2, 4, 8]), numel=st.integers(0, 5000), seed=st.integers(0, 2**32 - 1),
       density=st.sampled_from([0.0, 0.0005, 0.01, 0.15, 0.6, 1.0]), chunk=st.sampled_from([8, 64, 1000, 4096]))
def test_mixed_round_trip_is_exact(itemsize, numel, seed, density, chunk):
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, numel * itemsize, dtype=np.uint8)
    new = old.copy()
    mask = np.repeat(rng.random(numel) < density, itemsize) & (rng.random(numel * itemsize) < 0.7)
    new[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    enc, target = roundtrip(CodecSpec("mixed", "byteplane", chunk), old, new, itemsize)
    assert np.array_equal(target, new)
    assert (enc.payload is None) == np.array_equal(old, new)
    assert enc.encoding in ("xor", "sparse", "overwrite")
    assert enc.changed_bytes == int(np.count_nonzero(old != new))


def test_each_tensor_takes_the_smallest_encoding():
    sparse_old, sparse_new = bf16_step(200_000, 0.01)
    dense_old, dense_new = bf16_step(200_000, 0.6)
    tiny_old, tiny_new = bf16_step(200_000, 0.0001)
    items = [("sparse", sparse_old, sparse_new, 2), ("dense", dense_old, dense_new, 2), ("tiny", tiny_old, tiny_new, 2)]
    got = {e.name: e for e in encode_tensors(POOL, MIXED, "xxh3-128", items)}
    assert got["sparse"].encoding == "sparse" and got["dense"].encoding == "xor"
    assert got["tiny"].encoding in ("sparse", "overwrite")
    for name, old, new, _ in items:  # never larger than XOR byte planes alone
        [plain] = encode_tensors(POOL, CodecSpec("xor", "byteplane", 4096), "xxh3-128", [(name, old, new, 2)])
        assert len(got[name].payload) <= len(plain.payload), name


def test_a_tensor_with_dense_and_sparse_regions_round_trips():
    old, new = bf16_step(100_000, 0.005)
    dense_old, dense_new = bf16_step(20_000, 0.9, seed=1)
    old[:dense_old.size], new[:dense_new.size] = dense_old, dense_new  # first chunks dense, the rest sparse
    enc, target = roundtrip(MIXED, old, new, 2)
    assert enc.encoding == "xor" and np.array_equal(target, new)


def test_long_gaps_are_escaped_exactly():
    old = np.zeros(2 * 300_000, dtype=np.uint8)
    new = old.copy()
    for element in (0, 1, 70_000, 70_001, 299_999):  # gaps of 0, 69_998, 229_997
        new[2 * element] = 5
    enc, target = roundtrip(CodecSpec("mixed", "byteplane", 1 << 22), old, new, 2)
    assert enc.encoding in ("sparse", "overwrite") and np.array_equal(target, new)
    words = (old ^ new).view("<u2")
    positions, values = parse_sparse(sparse_raw(words[words != 0], np.flatnonzero(words)), words.size, 2, "t")
    assert positions.tolist() == [0, 1, 70_000, 70_001, 299_999] and values.tolist() == [5] * 5


def sparse_payload(raw: bytes) -> bytes:
    frame = zstandard.ZstdCompressor(level=1).compress(raw)
    return struct.pack("<II", 1, len(frame)) + frame


def header(count: int, escapes: int) -> bytes:
    return struct.pack("<II", count, escapes)


MALFORMED = {
    "more changes than elements": header(5000, 0) + bytes(5000 * 4),
    "size does not match the counts": header(3, 0) + bytes(5),
    "position outside the chunk": header(1, 0) + struct.pack("<H", 4000) + b"\x01\x00",
    "escape count disagrees": header(2, 1) + b"\xff\xff" + b"\xff\xff" + struct.pack("<I", 1) + b"\x01\x01\x00\x00",
    "escaped gap outside the chunk": header(1, 1) + b"\xff\xff" + struct.pack("<I", 2**31) + b"\x01\x00",
    "shorter than its header": b"\x01\x00",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_sparse_payload_is_a_format_error_and_writes_nothing(case):
    raw = MALFORMED[case]
    old = np.arange(2 * 1000, dtype=np.uint16).view(np.uint8)[:2000].copy()
    target = old.copy()
    spec = CodecSpec("mixed", "byteplane", 1 << 20)
    with pytest.raises(FormatError):
        list(decode_tensors(POOL, spec, "xxh3-128", [("t", target, memoryview(sparse_payload(raw)), 2, "00")],
                            encodings={"t": "sparse"}))
    assert np.array_equal(target, old)


def test_oversized_or_corrupt_sparse_frames_are_refused_before_inflating():
    target = np.zeros(2000, dtype=np.uint8)
    bomb = sparse_payload(bytes(10_000_000))
    corrupt = bytearray(sparse_payload(header(1, 0) + b"\x00\x00\x01\x00"))
    corrupt[-6] ^= 0xFF
    for payload in (bomb, bytes(corrupt), b"\x01\x00"):
        with pytest.raises(FormatError):
            list(decode_tensors(POOL, MIXED, "xxh3-128", [("t", target, memoryview(payload), 2, "00")],
                                encodings={"t": "sparse"}))
    assert not target.any()


def index_json(delta_encoding: str, filt: str, tensor: dict) -> dict:
    return {"metadata": {"version": "000001", "base_version": "000000", "delta_encoding": delta_encoding,
                         "compression_format": "zstd", "checksum_format": "xxh3-128", "run_id": "r", "filter": filt,
                         "tensors": {"w": tensor}},
            "weight_map": {"w": "model-00000-of-00001.safetensors"}}


@pytest.mark.parametrize("delta_encoding,filt,tensor,match", [
    ("mixed", "byteplane", {"dtype": "BF16", "shape": [4], "nbytes": 8}, "needs an encoding"),
    ("mixed", "byteplane", {"dtype": "BF16", "shape": [4], "nbytes": 8, "encoding": "rle"}, "unknown encoding"),
    ("mixed", "none", {"dtype": "BF16", "shape": [4], "nbytes": 8, "encoding": "sparse"}, "byteplane"),
    ("xor", "byteplane", {"dtype": "BF16", "shape": [4], "nbytes": 8, "encoding": "sparse"}, "differs"),
])
def test_index_encodings_are_validated(delta_encoding, filt, tensor, match):
    with pytest.raises(FormatError, match=match):
        parse_index(index_json(delta_encoding, filt, tensor), "v1")


def test_index_records_a_tensor_encoding_only_where_it_is_not_the_versions():
    layouts = {"a": TensorLayout("BF16", (4,), 8, "sparse"), "b": TensorLayout("BF16", (4,), 8, "xor")}
    for version_encoding, want in (("mixed", {"a": "sparse", "b": "xor"}), ("xor", None)):
        index = VersionIndex(1, 0, "r", version_encoding, "zstd", "xxh3-128", "byteplane", 4096,
                             {"a": "f.safetensors"}, layouts if version_encoding == "mixed" else
                             {"a": TensorLayout("BF16", (4,), 8, "xor")})
        tensors = index.to_json()["metadata"]["tensors"]
        if want is None:
            assert "encoding" not in tensors["a"]
        else:
            assert {n: t["encoding"] for n, t in tensors.items()} == want
            assert parse_index(index.to_json(), "v1").encodings == want


def test_a_reader_that_predates_mixed_refuses_it():
    """Readers knowing only xor/overwrite/full (this project before ``mixed``, stock consumers) fail
    on the version-level delta_encoding rather than decode a sparse payload as XOR planes."""
    from miles_disagg.weights import format as format_module

    obj = index_json("mixed", "byteplane", {"dtype": "BF16", "shape": [4], "nbytes": 8, "encoding": "sparse"})
    old_encodings = ("xor", "overwrite", "full")
    with pytest.raises(FormatError, match="unknown delta_encoding 'mixed'"):
        format_module._choice(obj["metadata"], "delta_encoding", old_encodings, "v1")
    assert obj["metadata"]["delta_encoding"] not in old_encodings


def test_publish_spec_is_mixed_only_for_xor_with_byte_planes():
    assert publish_spec("xor", "byteplane").encoding == "mixed"
    assert publish_spec("overwrite", "byteplane").encoding == "overwrite"  # idempotent stays overwrite
    assert publish_spec("xor", "none").encoding == "xor"  # the plain format is unchanged
    assert publish_spec("xor", "byteplane", anchor=True).encoding == "full"


def adamw_checkpoint(lr: float, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from miles_disagg.bench.adamw_deltas import make_adamw_model

    old, new = make_adamw_model(2.0, lr, seed)
    to_tensor = lambda a: torch.from_numpy(a.copy()).view(torch.bfloat16)  # noqa: E731
    return {n: to_tensor(a) for n, a in old.items()}, {n: to_tensor(a) for n, a in new.items()}


def test_a_published_mixed_version_is_applied_and_verified_by_engines_and_the_cli(tmp_path):
    import os
    import subprocess
    import sys

    from miles_disagg.bench.adamw_deltas import lr_for_density

    old, new = adamw_checkpoint(lr_for_density(0.01, size_mb=1.0))
    base = write_checkpoint(tmp_path / "base", old)
    store = tmp_path / "store"
    pub = DeltaPublisher(store, base_dir=base, run_id="r", chunk_bytes=64 * 1024)
    pub.capture_baseline()
    result = pub.publish(new.items())
    pub.close()
    index = json.loads((store / "weight_v000001" / INDEX_NAME).read_text())["metadata"]
    assert index["delta_encoding"] == "mixed" and result.delta_encoding == "mixed"
    encodings = {t["encoding"] for t in index["tensors"].values()}
    assert "sparse" in encodings and encodings <= {"xor", "sparse", "overwrite"}
    assert "model.embed_tokens.weight" not in index["tensors"]  # frozen: not published

    host = Materializer(tmp_path / "local", base_dir=base)
    host.prepare(store, 1)
    from safetensors.torch import load_file

    held = load_file(str(tmp_path / "local" / "model.safetensors"))
    assert all(torch.equal(held[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    assert verify_version(VersionStore(store), base_dir=base)["final_checksums_verified"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "miles_disagg.cli", "weights"]
    applied = subprocess.run(cli + ["apply", "--store", str(store), "--base-dir", str(base), "--local-dir",
                                    str(tmp_path / "cli-host")], env=env, capture_output=True, text=True, timeout=300)
    assert applied.returncode == 0, applied.stderr
    held = load_file(str(tmp_path / "cli-host" / "model.safetensors"))
    assert all(torch.equal(held[n].view(torch.int16), new[n].view(torch.int16)) for n in new)
    verified = subprocess.run(cli + ["verify", "--store", str(store)], env=env, capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0 and json.loads(verified.stdout)["ok"], verified.stderr

    # a tensor whose per-tensor encoding is tampered with is refused, and the host is unchanged
    path = store / "weight_v000001" / INDEX_NAME
    obj = json.loads(path.read_text())
    name = next(n for n, t in obj["metadata"]["tensors"].items() if t["encoding"] == "sparse")
    del obj["metadata"]["tensors"][name]["encoding"]
    path.write_text(json.dumps(obj))
    with pytest.raises(FormatError, match="needs an encoding"):
        Materializer(tmp_path / "other", base_dir=base).prepare(store, 1)
