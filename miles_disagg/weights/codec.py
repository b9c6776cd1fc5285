"""Per-tensor byte deltas: ``xor`` / ``overwrite`` / ``full`` / ``mixed``, optional byte planes, zstd.

Wire format of one tensor's payload (a 1-D uint8 tensor in a payload file):

* filter ``none`` (the plain format other disk-delta producers write): ONE zstd frame of
  the whole tensor's delta. ``xor``: ``old ^ new``; ``overwrite``:
  ``[u32 count][u32 byte positions...][new bytes...]`` (little-endian; idempotent);
  ``full``: the new bytes.
* filter ``byteplane``: the tensor is cut into chunks of ``chunk_bytes``; a chunk of a
  2-byte dtype is split into its low-byte and high-byte planes (other dtypes: one plane)
  and each plane is delta-encoded as above (positions counted within the plane) and
  compressed as its own zstd frame. Payload: ``[u32 num_frames][u32 frame sizes...]``
  then the frames, chunk-major. A size-0 frame means "no change in this plane".
  An ``xor``/``full`` plane of ``m`` bytes decompresses either to exactly ``m`` bytes
  (dense) or, when that is smaller, to fewer: a sparse plane,
  ``[bitmap of non-zero positions: ceil(m/8) bytes, MSB-first as numpy.packbits]
  [the non-zero bytes in position order]``; the size tells the two apart.
  The high byte of a bf16 (sign + exponent) almost never changes, so its plane
  compresses to nothing; the low plane's changed bytes are scattered, which zstd's
  match finder handles slowly and poorly, so coding them as bitmap + values is both
  smaller and several times faster.
* ``mixed`` (byteplane only; what ``xor`` with byte planes publishes): each tensor takes
  the smallest of ``xor`` (as above), ``overwrite`` (as above) and ``sparse`` (one frame
  per chunk of gap-coded positions + XOR values, :mod:`miles_disagg.weights.sparse`),
  named per tensor in the index (:mod:`miles_disagg.weights.mixed`).

Encoding and decoding fan out over a thread pool at chunk granularity (numpy, zstd and
the hashers release the GIL). Each worker thread owns one compressor, one decompressor
and preallocated scratch buffers: zstd objects are not thread-safe, and fresh
allocations page-fault on every chunk.
"""

from __future__ import annotations

import struct
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import numpy as np

from miles_disagg.types import ChecksumMismatch, FormatError, LayoutMismatch
from miles_disagg.weights.checksums import checksum
from miles_disagg.weights.format import DEFAULT_CHUNK_BYTES, CodecSpec
from miles_disagg.weights.planes import (
    ThreadScratch, byte_planes, compress_plane, expand_plane, overwrite_payload, thread_scratch,
)
from miles_disagg.weights.mixed import choose_encoding, encode_chunk_choices
from miles_disagg.weights.sparse import (
    apply_sparse, element_size, element_view, max_raw_bytes, parse_sparse, sparse_raw, sparse_sections,
)

PUBLISH_ENCODINGS = ("xor", "overwrite")  # what a publisher may be asked for
_U32 = struct.Struct("<I")


def publish_spec(encoding: str, filter: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES, anchor: bool = False) -> CodecSpec:
    """The spec a version is published with: ``full`` for an anchor; ``mixed`` (each tensor the
    smallest of xor/sparse/overwrite) for ``xor`` with byte planes; else ``encoding`` as asked
    (``overwrite`` stays overwrite everywhere: it is the idempotent choice)."""
    if anchor:
        return CodecSpec("full", filter, chunk_bytes)
    if encoding == "xor" and filter == "byteplane":
        return CodecSpec("mixed", filter, chunk_bytes)
    return CodecSpec(encoding, filter, chunk_bytes)


def encode_chunk(spec: CodecSpec, old: np.ndarray, new: np.ndarray, itemsize: int) -> tuple[list[bytes], int]:
    """Encode one chunk; returns (one compressed frame per plane, changed byte count).

    ``xor``/``overwrite`` frames are ``b""`` where a plane did not change.
    """
    s = thread_scratch()
    num_planes = spec.num_planes(itemsize)
    diff = s.get("xor", new.nbytes)
    np.bitwise_xor(old, new, out=diff)
    changed = int(np.count_nonzero(diff))
    if spec.encoding == "sparse":
        words = element_view(diff, itemsize)
        positions = np.flatnonzero(words)
        if not positions.size:
            return [b""], changed
        return [s.compress_sections(sparse_sections(sparse_raw(words[positions], positions)))], changed
    if spec.encoding == "xor":
        if changed == 0:
            return [b""] * num_planes, 0
        planes = byte_planes(diff, num_planes, "x", s)
        return [compress_plane(spec, p, s, allow_empty=True) for p in planes], changed
    if spec.encoding == "full":
        return [compress_plane(spec, p, s, allow_empty=False) for p in byte_planes(new, num_planes, "n", s)], changed
    if changed == 0:
        return [b""] * num_planes, 0
    old_planes = byte_planes(old, num_planes, "o", s)
    new_planes = byte_planes(new, num_planes, "n", s)
    frames = []
    for old_p, new_p in zip(old_planes, new_planes):
        raw, _ = overwrite_payload(old_p, new_p)
        frames.append(s.compress(spec, raw) if raw else b"")
    return frames, changed


def _decompress(frame: memoryview, max_bytes: int, s: ThreadScratch, name: str) -> np.ndarray:
    """Decompress one frame, refusing (before allocating) more than ``max_bytes`` of output."""
    import zstandard

    try:
        size = zstandard.frame_content_size(frame)
        if size > max_bytes:
            raise LayoutMismatch(f"tensor {name!r}: a delta frame holds {size} bytes, more than the local tensor allows ({max_bytes})")
        if size >= 0:
            raw = s.decompressor.decompress(frame)
        else:  # producers that stream do not record the size: read at most one byte too many
            raw = _read_bounded(s, frame, max_bytes + 1)
    except zstandard.ZstdError as exc:
        raise FormatError(f"tensor {name!r}: corrupt zstd frame ({exc})") from None
    if len(raw) > max_bytes:
        raise LayoutMismatch(f"tensor {name!r}: a delta frame holds {len(raw)} bytes, more than the local tensor allows ({max_bytes})")
    return np.frombuffer(raw, dtype=np.uint8)


def _sparse_raw_of(frame: memoryview, elements: int, itemsize: int, s: ThreadScratch, name: str) -> np.ndarray:
    """A sparse chunk's raw form; a frame larger than any sparse form of the chunk is malformed."""
    try:
        return _decompress(frame, max_raw_bytes(elements, itemsize), s, name)
    except LayoutMismatch as exc:
        raise FormatError(f"malformed sparse payload: {exc}") from None


def _read_bounded(s: ThreadScratch, frame: memoryview, limit: int) -> bytes:
    """Decompress a frame without a recorded size, stopping after ``limit`` bytes of output."""
    parts, total = [], 0
    with s.decompressor.stream_reader(frame) as reader:
        while total < limit:
            block = reader.read(min(1 << 22, limit - total))
            if not block:
                break
            parts.append(block)
            total += len(block)
    return b"".join(parts)


def _apply_overwrite(plane: np.ndarray, raw: np.ndarray, name: str) -> None:
    if raw.nbytes < 4:
        raise FormatError(f"tensor {name!r}: overwrite payload shorter than its count field")
    count = int(raw[:4].view("<u4")[0])
    if raw.nbytes != 4 + 5 * count:
        raise FormatError(f"tensor {name!r}: overwrite payload of {raw.nbytes} bytes does not hold {count} changes")
    positions = raw[4:4 + 4 * count].view("<u4")
    if count and int(positions.max()) >= plane.size:
        raise FormatError(f"tensor {name!r}: overwrite position {int(positions.max())} outside {plane.size} bytes")
    plane[positions] = raw[4 + 4 * count:]


def decode_chunk(spec: CodecSpec, target: np.ndarray, frames: list[memoryview], itemsize: int, name: str) -> None:
    """Apply one chunk's frames onto ``target`` (a writable uint8 view of the chunk) in place."""
    s = thread_scratch()
    if spec.encoding == "sparse":
        if len(frames[0]):
            apply_sparse(target, _sparse_raw_of(frames[0], element_view(target, itemsize).size, itemsize, s, name),
                         itemsize, name)
        return
    num_planes = spec.num_planes(itemsize)
    m = target.nbytes // num_planes
    lanes = target.reshape(m, num_planes)  # column i = plane i (a strided view)
    max_bytes = 4 + 5 * m if spec.encoding == "overwrite" else m + 1  # +1: report oversized deltas
    raws: list[np.ndarray | None] = []
    for i, frame in enumerate(frames):
        raw = _decompress(frame, max_bytes, s, name) if len(frame) else None
        if raw is not None and spec.encoding != "overwrite":
            if spec.filter == "none" and raw.nbytes != m:
                raise LayoutMismatch(f"tensor {name!r}: the delta covers {raw.nbytes} bytes, the local tensor has {m}")
            raw = expand_plane(raw, m, f"plane{i}", s, name)
        raws.append(raw)
    if spec.encoding == "overwrite":
        for i, raw in enumerate(raws):
            if raw is not None:
                _apply_overwrite(target if num_planes == 1 else lanes[:, i], raw, name)
        return
    if spec.encoding == "full" and any(r is None for r in raws):
        raise FormatError(f"tensor {name!r}: full payload has an empty plane")
    if num_planes == 1:
        if raws[0] is not None:
            if spec.encoding == "full":
                np.copyto(target, raws[0])
            else:
                np.bitwise_xor(target, raws[0], out=target)
        return
    words = s.get("dec", 2 * m).view("<u2")
    lo, hi = raws
    if hi is not None:
        np.copyto(words, hi, casting="unsafe")
        np.left_shift(words, 8, out=words)
        if lo is not None:
            np.bitwise_or(words, lo, out=words)
    elif lo is not None:
        np.copyto(words, lo, casting="unsafe")
    else:
        return
    out = target.view("<u2")
    if spec.encoding == "full":
        np.copyto(out, words)
    else:
        np.bitwise_xor(out, words, out=out)


def check_frames(spec: CodecSpec, payload: memoryview, nbytes: int, itemsize: int, name: str) -> None:
    """Decompress every frame of one payload and check its size, without a target.

    ``nbytes`` is the tensor's size (from the index's layout, or the base checkpoint's for a
    plain payload without one): no frame is decompressed beyond what that size allows.
    """
    s = thread_scratch()
    planes = spec.num_planes(itemsize)
    for (a, b), frames in zip(spec.chunks(nbytes, itemsize), split_frames(spec, payload, nbytes, itemsize, name)):
        if spec.encoding == "sparse":
            if len(frames[0]):
                elements = (b - a) // element_size(itemsize)
                parse_sparse(_sparse_raw_of(frames[0], elements, itemsize, s, name), elements, itemsize, name)
            continue
        m = (b - a) // planes
        for i, frame in enumerate(frames):
            if not len(frame):
                continue
            raw = _decompress(frame, 4 + 5 * m if spec.encoding == "overwrite" else m + 1, s, name)
            if spec.encoding != "overwrite":
                if spec.filter == "none" and raw.nbytes != m:
                    raise LayoutMismatch(f"tensor {name!r}: the delta covers {raw.nbytes} bytes, the tensor has {m}")
                expand_plane(raw, m, f"plane{i}", s, name)


# ------------------------------------------------------------------ payload framing


def join_frames(spec: CodecSpec, frames: list[bytes]) -> bytes:
    """One tensor's payload from its frames (chunk-major, plane-minor)."""
    if spec.filter == "none":
        return frames[0]
    header = struct.pack(f"<I{len(frames)}I", len(frames), *(len(f) for f in frames))
    return header + b"".join(frames)


def split_frames(spec: CodecSpec, payload: memoryview, nbytes: int, itemsize: int, name: str) -> list[list[memoryview]]:
    """Inverse of :func:`join_frames`: frames per chunk; ``FormatError`` if the payload is malformed."""
    chunks = spec.chunks(nbytes, itemsize)
    if spec.filter == "none":
        return [[payload]]
    num_planes = spec.frames_per_chunk(itemsize)
    expected = len(chunks) * num_planes
    if len(payload) < 4 or _U32.unpack_from(payload, 0)[0] != expected or len(payload) < 4 + 4 * expected:
        raise FormatError(f"tensor {name!r}: payload header does not describe {expected} frames")
    sizes = struct.unpack_from(f"<{expected}I", payload, 4)
    pos = 4 + 4 * expected
    if pos + sum(sizes) != len(payload):
        raise FormatError(f"tensor {name!r}: payload is {len(payload)} bytes, frames need {pos + sum(sizes)}")
    frames = []
    for size in sizes:
        frames.append(payload[pos:pos + size])
        pos += size
    return [frames[i:i + num_planes] for i in range(0, expected, num_planes)]


# ------------------------------------------------------------------ whole tensors over a pool


@dataclass(frozen=True)
class EncodedTensor:
    name: str
    payload: bytes | None  # None: unchanged (not published)
    changed_bytes: int
    nbytes: int
    checksum: str
    encoding: str = ""  # the per-tensor encoding used (xor/overwrite/sparse/full); a mixed spec's choice


@dataclass
class _PendingEncode:
    name: str
    nbytes: int
    chunk_futures: list[Future]
    hash_future: Future
    old: np.ndarray
    new: np.ndarray
    itemsize: int


def encode_tensors(pool: ThreadPoolExecutor, spec: CodecSpec, checksum_format: str,
                   items: Iterable[tuple[str, np.ndarray, np.ndarray, int]],
                   max_inflight_bytes: int = 256 * 1024 * 1024) -> Iterator[EncodedTensor]:
    """Encode ``(name, old, new, itemsize)`` items (uint8 arrays) in input order.

    Chunks of several tensors are in flight at once; at most ``max_inflight_bytes`` of
    input is pending, so a caller streaming tensors one at a time keeps memory bounded.
    """
    pending: deque[_PendingEncode] = deque()
    inflight = 0
    chunk_encoder = encode_chunk_choices if spec.encoding == "mixed" else encode_chunk
    for name, old, new, itemsize in items:
        futures = [pool.submit(chunk_encoder, spec, old[a:b], new[a:b], itemsize) for a, b in spec.chunks(new.nbytes, itemsize)]
        pending.append(_PendingEncode(name, new.nbytes, futures, pool.submit(checksum, checksum_format, new), old, new, itemsize))
        inflight += new.nbytes
        while pending and inflight > max_inflight_bytes:
            inflight -= pending[0].nbytes
            yield _finish_encode(spec, pending.popleft())
    while pending:
        yield _finish_encode(spec, pending.popleft())


def _finish_encode(spec: CodecSpec, item: _PendingEncode) -> EncodedTensor:
    if spec.encoding == "mixed":
        return _finish_mixed(spec, item)
    frames: list[bytes] = []
    changed = 0
    for future in item.chunk_futures:
        chunk_frames, chunk_changed = future.result()
        frames.extend(chunk_frames)
        changed += chunk_changed
    digest = item.hash_future.result()
    if changed == 0 and spec.encoding != "full":
        return EncodedTensor(item.name, None, 0, item.nbytes, digest, spec.encoding)
    return EncodedTensor(item.name, join_frames(spec, frames), changed, item.nbytes, digest, spec.encoding)


def _finish_mixed(spec: CodecSpec, item: _PendingEncode) -> EncodedTensor:
    """Pick the tensor's encoding from its chunks' candidates and join that encoding's frames."""
    chunks = [future.result() for future in item.chunk_futures]
    digest = item.hash_future.result()
    encoding = choose_encoding(chunks)
    if encoding is None:
        return EncodedTensor(item.name, None, 0, item.nbytes, digest, "xor")
    if not encoding:  # dense and sparse chunks: xor byte planes for all (rare: one region changed)
        encoding = "xor"
        ranges = spec.chunks(item.nbytes, item.itemsize)
        chunks = [c if not c[0] or "xor" in c[0]
                  else ({"xor": encode_chunk(spec.for_tensor("xor"), item.old[a:b], item.new[a:b], item.itemsize)[0]}, c[1])
                  for c, (a, b) in zip(chunks, ranges)]
    tensor_spec = spec.for_tensor(encoding)
    empty = [b""] * tensor_spec.frames_per_chunk(item.itemsize)
    frames = [f for choices, _ in chunks for f in choices.get(encoding, empty)]
    changed = sum(c for _, c in chunks)
    return EncodedTensor(item.name, join_frames(tensor_spec, frames), changed, item.nbytes, digest, encoding)


def decode_tensors(pool: ThreadPoolExecutor, spec: CodecSpec, checksum_format: str,
                   items: Iterable[tuple[str, np.ndarray, memoryview, int, str]],
                   max_inflight_bytes: int = 256 * 1024 * 1024,
                   encodings: Mapping[str, str] | None = None) -> Iterator[str]:
    """Apply ``(name, target, payload, itemsize, expected_checksum)`` items in place; yield names.

    ``encodings``: each tensor's encoding from the index (required for a ``mixed`` spec).

    Each target is verified against its final-state checksum before its name is
    yielded; a mismatch raises ``ChecksumMismatch`` (targets already yielded stay patched:
    callers apply into scratch space they can discard).
    """
    pending: deque[tuple[str, np.ndarray, str, list[Future]]] = deque()
    inflight = 0
    for name, target, payload, itemsize, expected in items:
        tensor_spec = _tensor_spec(spec, encodings, name)
        frames = split_frames(tensor_spec, payload, target.nbytes, itemsize, name)
        ranges = tensor_spec.chunks(target.nbytes, itemsize)
        futures = [pool.submit(decode_chunk, tensor_spec, target[a:b], f, itemsize, name) for (a, b), f in zip(ranges, frames)]
        pending.append((name, target, expected, futures))
        inflight += target.nbytes
        while pending and inflight > max_inflight_bytes:
            inflight -= pending[0][1].nbytes
            yield _finish_decode(checksum_format, *pending.popleft())
    while pending:
        yield _finish_decode(checksum_format, *pending.popleft())


def _tensor_spec(spec: CodecSpec, encodings: Mapping[str, str] | None, name: str) -> CodecSpec:
    try:
        return spec.for_tensor((encodings or {}).get(name, ""))
    except FormatError as exc:
        raise FormatError(f"tensor {name!r}: {exc}") from None


def _finish_decode(checksum_format: str, name: str, target: np.ndarray, expected: str, futures: list[Future]) -> str:
    for future in futures:
        future.result()
    actual = checksum(checksum_format, target)
    if actual != expected:
        raise ChecksumMismatch(name, expected, actual, checksum_format)
    return name
