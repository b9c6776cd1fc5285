"""The ``sparse`` per-tensor encoding: gap-coded positions of the changed elements + their XOR values.

One chunk of a tensor (the byte-plane chunking of :class:`miles_disagg.weights.format.CodecSpec`)
becomes ONE zstd frame (level 1, with zstd's frame checksum) of::

    [u32 count][u32 escapes]
    [gap low bytes: count x u8][gap high bytes: count x u8]
    [escaped gaps: escapes x u32]      the gaps whose 16-bit field is 0xFFFF, in order
    [value planes: k x count]          byte j of each changed element's XOR, plane-major

all little-endian. Positions are element indices within the chunk (``k`` = the dtype's item size
for 1/2/4/8-byte dtypes, else 1: bytes); gap = position - previous position - 1 (the first gap is
the first position). An unchanged chunk is an empty frame (size 0), as for byte planes.

The frame is compressed in sections (:func:`sparse_sections`), each in zstd blocks of its own (one
standard frame: any zstd decoder reads it).

Why: below a few percent of elements changed, a bitmap of the changed positions costs one bit per
element whatever the density, while a gap costs about ``log2(1/density) + 1.4`` bits per CHANGED
element. Gaps as two byte planes let zstd's entropy coder reach close to that at every density
(the high plane is almost all zero above 1% density); the XOR values of bf16 deltas are
low-entropy (the exponent byte almost never changes) and split into planes for the same reason.

Decoding refuses (``FormatError``) any payload whose counts, escapes or positions do not fit the
chunk, before writing anything to the target.
"""

from __future__ import annotations

import struct

import numpy as np

from miles_disagg.types import FormatError

_HEADER = struct.Struct("<II")
ESCAPE = 0xFFFF

WORD_DTYPES = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def element_size(itemsize: int) -> int:
    """Bytes per sparse element: the dtype's item size where numpy has an integer of that size, else 1."""
    return itemsize if itemsize in WORD_DTYPES else 1


def element_view(data: np.ndarray, itemsize: int) -> np.ndarray:
    """``data`` (uint8) as unsigned integers of ``element_size(itemsize)`` bytes."""
    return data.view(WORD_DTYPES[element_size(itemsize)])


def sparse_raw(values: np.ndarray, positions: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The uncompressed sparse form of one chunk (a uint8 array, in ``out`` when it is large enough):
    ``positions`` are the ascending indices of its changed elements, ``values`` their XOR (as elements)."""
    count, k = positions.size, values.itemsize
    gaps = np.empty(count, dtype=np.int64)
    if count:
        gaps[0] = positions[0]
        np.subtract(positions[1:], positions[:-1], out=gaps[1:])
        gaps[1:] -= 1
    escaped = gaps >= ESCAPE
    escapes = gaps[escaped].astype("<u4") if escaped.any() else np.empty(0, dtype="<u4")
    gaps16 = gaps.astype("<u2")
    if escapes.size:
        gaps16[escaped] = ESCAPE
    size = _HEADER.size + count * (2 + k) + 4 * escapes.size
    raw = out[:size] if out is not None and out.nbytes >= size else np.empty(size, dtype=np.uint8)
    raw[:_HEADER.size] = np.frombuffer(_HEADER.pack(count, escapes.size), dtype=np.uint8)
    pos = _HEADER.size
    pos = _put_planes(raw, pos, gaps16, count, 2)
    raw[pos:pos + 4 * escapes.size] = escapes.view(np.uint8)
    _put_planes(raw, pos + 4 * escapes.size, values, count, k)
    return raw


def sparse_sections(raw: np.ndarray) -> list[np.ndarray]:
    """The raw sparse form split where its statistics change: header and gap low bytes, gap high bytes,
    escaped gaps and each value plane (compressed each in blocks of its own)."""
    count, escapes = _HEADER.unpack_from(raw, 0)
    if count == 0:
        return [raw]
    k = (raw.nbytes - _HEADER.size - 4 * escapes) // count - 2
    bounds = [_HEADER.size + count, _HEADER.size + 2 * count + 4 * escapes]
    bounds += [bounds[-1] + j * count for j in range(1, k)]
    return [raw[a:b] for a, b in zip([0, *bounds], [*bounds, raw.nbytes]) if b > a]


def changed_elements(old: np.ndarray, new: np.ndarray, itemsize: int, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(positions, XOR values) of the elements that differ between two chunks (uint8 arrays).

    ``mask`` is bool scratch space of one entry per element. One compare pass and one scan of the
    mask: no XOR of the whole chunk is materialized.
    """
    old_words, new_words = element_view(old, itemsize), element_view(new, itemsize)
    np.not_equal(old_words, new_words, out=mask)
    positions = np.flatnonzero(mask)
    return positions, old_words[positions] ^ new_words[positions]


def changed_elements_few(old: np.ndarray, new: np.ndarray, itemsize: int, hit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`changed_elements` for chunks where few 8-byte words changed (``hit``: their indices).

    Only the changed words are expanded into their elements, so a chunk at a fraction of a percent
    costs one compare pass at 8-byte granularity and little else.
    """
    k = element_size(itemsize)
    lanes = 8 // k
    changed = np.take(old.view("<u8"), hit)
    changed ^= np.take(new.view("<u8"), hit)
    flat = changed.view(WORD_DTYPES[k])  # each word's elements, in memory order
    index = np.flatnonzero(flat != 0)
    positions = hit[index // lanes] * lanes + index % lanes if lanes > 1 else hit[index]
    return positions, flat[index]


def _put_planes(raw: np.ndarray, pos: int, values: np.ndarray, count: int, k: int) -> int:
    """Write ``values`` (``count`` elements of ``k`` bytes) into ``raw`` at ``pos`` as ``k`` byte planes."""
    bytes_ = values.view(np.uint8).reshape(count, k)
    for j in range(k):
        raw[pos + j * count:pos + (j + 1) * count] = bytes_[:, j]
    return pos + k * count


def _get_planes(raw: np.ndarray, pos: int, count: int, k: int) -> np.ndarray:
    """Inverse of :func:`_put_planes`: ``count`` elements of ``k`` bytes (unsigned integers)."""
    out = np.empty(count, dtype=WORD_DTYPES[k])
    bytes_ = out.view(np.uint8).reshape(count, k)
    for j in range(k):
        bytes_[:, j] = raw[pos + j * count:pos + (j + 1) * count]
    return out


def raw_bound(count: int, num_elements: int, k: int) -> int:
    """The size of the raw sparse form of ``count`` changes among ``num_elements`` elements of ``k`` bytes, at most."""
    return _HEADER.size + count * (2 + k) + 4 * min(count, num_elements // ESCAPE + 1)


def max_raw_bytes(num_elements: int, itemsize: int) -> int:
    """The largest raw sparse form a chunk of ``num_elements`` elements can have (bounds decompression)."""
    return _HEADER.size + num_elements * (2 + element_size(itemsize)) + 4 * (num_elements // ESCAPE + 1)


def parse_sparse(raw: np.ndarray, num_elements: int, itemsize: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions, XOR values as elements) of one chunk's raw sparse form; ``FormatError`` if malformed."""
    k = element_size(itemsize)
    if raw.nbytes < _HEADER.size:
        raise FormatError(f"tensor {name!r}: sparse chunk shorter than its header")
    count, escapes = _HEADER.unpack_from(raw, 0)
    if count > num_elements or escapes > count:
        raise FormatError(f"tensor {name!r}: sparse chunk claims {count} changes ({escapes} escaped gaps) "
                          f"in {num_elements} elements")
    if raw.nbytes != _HEADER.size + count * (2 + k) + 4 * escapes:
        raise FormatError(f"tensor {name!r}: sparse chunk of {raw.nbytes} bytes does not hold {count} changes "
                          f"with {escapes} escaped gaps")
    gaps16 = _get_planes(raw, _HEADER.size, count, 2)
    pos = _HEADER.size + 2 * count
    escaped = gaps16 == ESCAPE
    found = int(np.count_nonzero(escaped))
    if found != escapes:
        raise FormatError(f"tensor {name!r}: sparse chunk has {found} escaped gaps, its header says {escapes}")
    positions = np.cumsum(gaps16, dtype=np.int64)
    if escapes:  # the rare long gaps: redo the sum with their full values
        gaps = gaps16.astype(np.int64)
        gaps[escaped] = raw[pos:pos + 4 * escapes].view("<u4")
        positions = np.cumsum(gaps, out=positions)
    positions += np.arange(count, dtype=np.int64)  # each gap excludes the changed element before it
    pos += 4 * escapes
    if count and int(positions[-1]) >= num_elements:
        raise FormatError(f"tensor {name!r}: sparse position {int(positions[-1])} outside {num_elements} elements")
    return positions, _get_planes(raw, pos, count, k)


def apply_sparse(target: np.ndarray, raw: np.ndarray, itemsize: int, name: str) -> None:
    """XOR one chunk's sparse changes into ``target`` (uint8, the chunk) in place; nothing is
    written when ``raw`` is malformed."""
    words = element_view(target, itemsize)
    positions, values = parse_sparse(raw, words.size, itemsize, name)
    words[positions] ^= values
