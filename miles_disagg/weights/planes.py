"""Byte planes of one chunk and the per-thread scratch space the codec works in.

A chunk of a 2-byte dtype is split into its low-byte and high-byte planes; each plane is
compressed as its own zstd frame, either dense or, when that is smaller, as a bitmap of its
non-zero bytes followed by those bytes (see :mod:`miles_disagg.weights.codec`'s format notes).
Each worker thread owns one compressor, one decompressor and reusable buffers: zstd objects are
not thread-safe, and fresh allocations page-fault on every chunk.
"""

from __future__ import annotations

import struct
import threading
import numpy as np

from miles_disagg.types import FormatError, LayoutMismatch
from miles_disagg.weights.format import CodecSpec

ZSTD_LEVEL = 1
_U32 = struct.Struct("<I")


class ThreadScratch(threading.local):
    """Per-thread zstd objects and reusable buffers (created lazily in each thread).

    ``checked`` compresses with zstd's frame checksum (byte-plane frames), ``plain`` without
    (the plain format); ``decompressor`` reads either. :meth:`get` hands out a reusable buffer
    per key: a caller owns it until it next asks for the same key in the same thread.
    """

    def __init__(self) -> None:
        import zstandard

        # byte-plane frames carry zstd's own frame checksum (corruption is reported at the
        # frame); plain frames are written exactly as other producers write them
        self.checked = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_checksum=True)
        self.plain = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
        self.decompressor = zstandard.ZstdDecompressor()
        self.buffers: dict[str, np.ndarray] = {}

    def compress(self, spec: CodecSpec, data: np.ndarray | bytes) -> bytes:
        """One zstd frame of ``data``: checksummed under the byteplane filter, plain otherwise."""
        return (self.checked if spec.filter == "byteplane" else self.plain).compress(data)

    def compress_sections(self, sections: list) -> bytes:
        """One checksummed zstd frame of the concatenated ``sections``, each in zstd blocks of its own:
        every block has its own entropy tables, so a uniform section (a gap's low bytes) does not
        spoil the coding of a skewed one (its high bytes, XOR values). Any zstd decoder reads it."""
        import zstandard

        total = sum(memoryview(part).nbytes for part in sections)
        stream = self.checked.compressobj(size=total)
        out = [stream.compress(part) + stream.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK) for part in sections[:-1]]
        out.append(stream.compress(sections[-1]) + stream.flush())
        return b"".join(out)

    def get(self, key: str, nbytes: int) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` for ``key`` (contents undefined), grown when too small."""
        buf = self.buffers.get(key)
        if buf is None or buf.nbytes < nbytes:
            buf = self.buffers[key] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return buf[:nbytes]


_scratch: ThreadScratch | None = None


def thread_scratch() -> ThreadScratch:
    """The calling thread's :class:`ThreadScratch` (one ``threading.local`` shared by the codec)."""
    global _scratch
    if _scratch is None:
        _scratch = ThreadScratch()
    return _scratch


def _split_planes(data: np.ndarray, out_key: str, s: ThreadScratch) -> list[np.ndarray]:
    """Low and high byte planes of a 2-byte-element buffer (contiguous copies in scratch)."""
    m = data.nbytes // 2
    words = data.view("<u2")
    lo, hi = s.get(out_key + ".lo", m), s.get(out_key + ".hi", m)
    np.copyto(lo, words, casting="unsafe")
    shifted = s.get(out_key + ".sh", 2 * m).view("<u2")
    np.right_shift(words, 8, out=shifted)
    np.copyto(hi, shifted, casting="unsafe")
    return [lo, hi]


def byte_planes(data: np.ndarray, num_planes: int, key: str, s: ThreadScratch) -> list[np.ndarray]:
    """``data`` (uint8) as ``num_planes`` planes: itself for 1, its low and high byte planes for 2.

    The two planes live in ``s``'s buffers under ``key``: valid until the next call with that key.
    """
    return [data] if num_planes == 1 else _split_planes(data, key, s)


def overwrite_payload(old: np.ndarray, new: np.ndarray) -> tuple[bytes, int]:
    """The ``overwrite`` form of one plane and its number of changed bytes (``b"", 0`` unchanged).

    ``[u32 count][u32 byte positions...][new bytes...]``, little-endian; ``LayoutMismatch`` for a
    plane whose positions do not fit in u32.
    """
    if new.size > 0xFFFFFFFF:
        raise LayoutMismatch(f"overwrite positions are u32: a plane of {new.size} bytes is too large (use xor or byteplane)")
    positions = np.flatnonzero(old != new).astype("<u4")
    if positions.size == 0:
        return b"", 0
    return _U32.pack(positions.size) + positions.tobytes() + new[positions].tobytes(), int(positions.size)


def compress_plane(spec: CodecSpec, plane: np.ndarray, s: ThreadScratch, *, allow_empty: bool) -> bytes:
    """One plane as a zstd frame: dense, or (byteplane filter only) sparse bitmap + values,
    whichever is smaller before compression. ``allow_empty``: an all-zero plane is ``b""``."""
    nonzero = int(np.count_nonzero(plane))
    if nonzero == 0 and allow_empty:
        return b""
    m = plane.size
    bitmap_bytes = (m + 7) // 8
    if spec.filter == "none" or bitmap_bytes + nonzero >= m:
        return s.compress(spec, plane)
    mask = s.get("mask", m).view(np.bool_)
    np.not_equal(plane, 0, out=mask)
    sparse = s.get("sparse", bitmap_bytes + nonzero)
    sparse[:bitmap_bytes] = np.packbits(mask)
    np.compress(mask, plane, out=sparse[bitmap_bytes:])
    return s.compress(spec, sparse)


def expand_plane(raw: np.ndarray, m: int, key: str, s: ThreadScratch, name: str) -> np.ndarray:
    """A decompressed plane of ``m`` bytes back in dense form: the inverse of the sparse form of
    :func:`compress_plane` (written into ``s``'s buffer ``key``); a dense plane passes through.

    ``LayoutMismatch`` when ``raw`` is larger than the plane; ``FormatError`` for a malformed sparse
    plane (``name``: the tensor, for the message)."""
    if raw.nbytes == m:
        return raw
    bitmap_bytes = (m + 7) // 8
    if raw.nbytes > m:
        raise LayoutMismatch(f"tensor {name!r}: a delta plane has {raw.nbytes} bytes, the local plane has {m}")
    if raw.nbytes < bitmap_bytes:
        raise FormatError(f"tensor {name!r}: sparse delta plane shorter than its bitmap")
    positions = np.flatnonzero(np.unpackbits(raw[:bitmap_bytes], count=m).view(np.bool_))
    if positions.size != raw.nbytes - bitmap_bytes:
        raise FormatError(f"tensor {name!r}: sparse delta plane has {raw.nbytes - bitmap_bytes} values for {positions.size} positions")
    plane = s.get(key, m)
    plane.fill(0)
    plane[positions] = raw[bitmap_bytes:]
    return plane
