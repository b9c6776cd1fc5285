"""Codec properties: exact round trips, idempotent overwrite, framing and corruption errors."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_disagg.types import ChecksumMismatch, FormatError, LayoutMismatch
from miles_disagg.weights.checksums import CHECKSUMS, checksum
from miles_disagg.weights.codec import decode_tensors, encode_tensors
from miles_disagg.weights.format import CodecSpec

POOL = ThreadPoolExecutor(2)


@st.composite
def tensor_pairs(draw):
    """(itemsize, old bytes, new bytes) with a random subset of elements/bytes changed."""
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    numel = draw(st.integers(0, 3000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, numel * itemsize, dtype=np.uint8)
    new = old.copy()
    density = draw(st.sampled_from([0.0, 0.001, 0.1, 0.5, 1.0]))
    mask = rng.random(new.size) < density
    if draw(st.booleans()):  # bf16-like: mostly low-byte changes
        mask[1::2] &= rng.random(mask[1::2].size) < 0.05
    new[mask] ^= rng.integers(1, 256, int(mask.sum()), dtype=np.uint8)
    return itemsize, old, new


def roundtrip(spec: CodecSpec, old: np.ndarray, new: np.ndarray, itemsize: int, algo: str = "xxh3-128", applies: int = 1):
    [enc] = list(encode_tensors(POOL, spec, algo, [("t", old, new, itemsize)]))
    target = old.copy()
    if enc.payload is None:
        assert np.array_equal(old, new) and spec.encoding != "full"
        return enc, target
    for _ in range(applies):
        list(decode_tensors(POOL, spec, algo, [("t", target, memoryview(enc.payload), itemsize, enc.checksum)]))
    return enc, target


@settings(max_examples=60, deadline=None)
@given(pair=tensor_pairs(), encoding=st.sampled_from(["xor", "overwrite", "full"]),
       filt=st.sampled_from(["byteplane", "none"]), chunk=st.sampled_from([8, 64, 1000, 4096]),
       algo=st.sampled_from(CHECKSUMS))
def test_round_trip_is_exact(pair, encoding, filt, chunk, algo):
    itemsize, old, new = pair
    spec = CodecSpec(encoding, filt, chunk)
    enc, target = roundtrip(spec, old, new, itemsize, algo)
    assert np.array_equal(target, new)
    assert enc.changed_bytes == int(np.count_nonzero(old != new))
    assert enc.checksum == checksum(algo, new)


@settings(max_examples=30, deadline=None)
@given(pair=tensor_pairs(), filt=st.sampled_from(["byteplane", "none"]))
def test_overwrite_applied_twice_is_idempotent(pair, filt):
    itemsize, old, new = pair
    _, target = roundtrip(CodecSpec("overwrite", filt, 64), old, new, itemsize, applies=2)
    assert np.array_equal(target, new)


def test_xor_applied_twice_reverts_and_is_caught_by_the_checksum():
    old = np.arange(4096, dtype=np.uint8)
    new = old.copy()
    new[::7] ^= 3
    with pytest.raises(ChecksumMismatch) as info:
        roundtrip(CodecSpec("xor", "byteplane", 1024), old, new, 2, applies=2)
    assert info.value.tensor == "t" and info.value.algorithm == "xxh3-128"


def test_unchanged_tensor_is_not_published_but_full_is():
    data = np.ones(100, dtype=np.uint8)
    for encoding in ("xor", "overwrite"):
        [enc] = encode_tensors(POOL, CodecSpec(encoding), "xxh3-128", [("t", data, data.copy(), 2)])
        assert enc.payload is None and enc.changed_bytes == 0
    [enc] = encode_tensors(POOL, CodecSpec("full"), "xxh3-128", [("t", data, data.copy(), 2)])
    assert enc.payload is not None


def test_plain_format_is_one_zstd_frame_of_the_xor():
    import zstandard

    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 10_000, dtype=np.uint8)
    new = old.copy()
    new[::3] += 1
    [enc] = encode_tensors(POOL, CodecSpec("xor", "none"), "xxh3-128", [("t", old, new, 2)])
    assert zstandard.ZstdDecompressor().decompress(enc.payload) == (old ^ new).tobytes()
    params = zstandard.get_frame_parameters(enc.payload)  # as other producers write it
    assert params.content_size == old.nbytes and not params.has_checksum
    [enc] = encode_tensors(POOL, CodecSpec("overwrite", "none"), "xxh3-128", [("t", old, new, 2)])
    raw = np.frombuffer(zstandard.ZstdDecompressor().decompress(enc.payload), np.uint8)
    count = int(raw[:4].view("<u4")[0])
    positions = raw[4:4 + 4 * count].view("<u4")
    assert np.array_equal(positions, np.flatnonzero(old != new)) and np.array_equal(raw[4 + 4 * count:], new[positions])


def test_byteplane_is_smaller_for_bf16_like_updates():
    import torch

    master = torch.randn(256, 1024) * 0.02
    old = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
    new = (master - 1e-5 * torch.sign(torch.randn_like(master))).bfloat16().view(torch.uint8).reshape(-1).numpy()
    [plain] = encode_tensors(POOL, CodecSpec("xor", "none"), "xxh3-128", [("t", old, new, 2)])
    [planes] = encode_tensors(POOL, CodecSpec("xor", "byteplane"), "xxh3-128", [("t", old, new, 2)])
    assert len(planes.payload) < len(plain.payload)


@pytest.mark.parametrize("filt", ["byteplane", "none"])
def test_corrupted_payload_fails_cleanly(filt):
    rng = np.random.default_rng(1)
    old = rng.integers(0, 256, 50_000, dtype=np.uint8)
    new = old.copy()
    new[::5] ^= 1
    spec = CodecSpec("xor", filt, 4096)
    [enc] = encode_tensors(POOL, spec, "xxh3-128", [("t", old, new, 2)])
    for position in (len(enc.payload) // 2, len(enc.payload) - 3):
        bad = bytearray(enc.payload)
        bad[position] ^= 0xFF
        with pytest.raises((FormatError, ChecksumMismatch, LayoutMismatch)):
            list(decode_tensors(POOL, spec, "xxh3-128", [("t", old.copy(), memoryview(bytes(bad)), 2, enc.checksum)]))
    with pytest.raises((FormatError, LayoutMismatch)):
        list(decode_tensors(POOL, spec, "xxh3-128", [("t", old.copy(), memoryview(enc.payload[:-10]), 2, enc.checksum)]))


def test_delta_of_the_wrong_size_is_a_layout_mismatch():
    old = np.zeros(1000, dtype=np.uint8)
    new = old.copy()
    new[3] = 1
    [enc] = encode_tensors(POOL, CodecSpec("xor", "none"), "xxh3-128", [("t", old, new, 2)])
    with pytest.raises(LayoutMismatch, match="1000"):
        list(decode_tensors(POOL, CodecSpec("xor", "none"), "xxh3-128", [("t", np.zeros(500, np.uint8), memoryview(enc.payload), 2, enc.checksum)]))


def test_unknown_encoding_or_filter_is_a_format_error():
    with pytest.raises(FormatError, match="encoding"):
        CodecSpec("rle")
    with pytest.raises(FormatError, match="filter"):
        CodecSpec("xor", "bitshuffle")


def test_checksums_are_the_standard_digests():
    import xxhash

    data = b"miles-disagg" * 100
    assert checksum("xxh3-128", data) == xxhash.xxh3_128(data).hexdigest()
    assert checksum("adler32", data) == f"{zlib.adler32(data):08x}"
    assert len(checksum("blake3", data)) == 64
    with pytest.raises(KeyError):
        checksum("md5", data)


def test_frames_without_content_size_and_oversized_frames():
    import zstandard

    old = np.zeros(4000, dtype=np.uint8)
    new = old.copy()
    new[::9] = 7
    streamer = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    frame = streamer.compress((old ^ new).tobytes()) + streamer.flush()
    target = old.copy()
    spec = CodecSpec("xor", "none")
    list(decode_tensors(POOL, spec, "xxh3-128", [("t", target, memoryview(frame), 2, checksum("xxh3-128", new))]))
    assert np.array_equal(target, new)
    huge = zstandard.ZstdCompressor(level=1).compress(bytes(1 << 20))  # claims 1 MiB for a 4000-byte tensor
    with pytest.raises(LayoutMismatch, match="more than the local tensor allows"):
        list(decode_tensors(POOL, spec, "xxh3-128", [("t", old.copy(), memoryview(huge), 2, "x")]))


def test_a_streamed_frame_is_decompressed_within_the_local_size():
    """Without a recorded content size the decoder stops after the local size (+1), not at the frame's end."""
    import zstandard

    streamer = zstandard.ZstdCompressor(level=1, write_content_size=False).compressobj()
    bomb = streamer.compress(bytes(64 << 20)) + streamer.flush()  # 64 MiB of zeros for a 4000-byte tensor
    assert zstandard.frame_content_size(bomb) == -1
    with pytest.raises(LayoutMismatch, match=r"holds 4002 bytes, more than the local tensor allows"):
        list(decode_tensors(POOL, CodecSpec("xor", "none"), "xxh3-128",
                            [("t", np.zeros(4000, np.uint8), memoryview(bomb), 2, "x")]))
