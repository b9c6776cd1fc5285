"""The ``mixed`` delta encoding: per tensor, the smallest of XOR byte planes, sparse and overwrite.

A ``mixed`` version (byte-plane filter only) records in its index, per changed tensor, which of
``xor`` (XOR, byte planes, dense or bitmap+values planes), ``sparse`` (gap-coded positions + XOR
values, :mod:`miles_disagg.weights.sparse`) or ``overwrite`` (byte positions + new bytes) its payload
uses. Readers that do not know ``mixed`` refuse the version (unknown ``delta_encoding``) instead of
misreading a payload.

Each chunk is encoded in the forms that can win at its density (measured on the chunk itself):

* at most ``XOR_ONLY_ABOVE`` of its elements changed: ``sparse`` (finding and coding the positions
  costs time that grows with the density; above it, byte planes encode faster and are at most a
  few percent larger, and above ~25% they are also smaller);
* at least ``SPARSE_ONLY_BELOW``: ``xor`` byte planes (below it, sparse is smaller, by 15% at 3%);
* at most ``OVERWRITE_BELOW``: ``overwrite``, built from the sparse positions at O(changes).

Between the bounds both candidates are encoded and the smaller is kept, so the choice is exact
where the two are close. A tensor takes the encoding whose chunks sum smallest among those every
changed chunk produced; should its chunks disagree entirely (dense and sparse regions), the chunks
lacking ``xor`` are encoded as ``xor`` too.
"""

from __future__ import annotations

import numpy as np

from miles_disagg.weights.format import CodecSpec
from miles_disagg.weights.planes import ThreadScratch, byte_planes, compress_plane, thread_scratch
from miles_disagg.weights.sparse import (
    changed_elements, changed_elements_few, element_size, raw_bound, sparse_raw, sparse_sections,
)

# Sparse is smaller than byte planes up to ~25% of elements changed, by 3% at 15-20% (AdamW deltas),
# but slower to encode above ~10%: above that, the few percent of wire are not worth the time.
SPARSE_ONLY_BELOW = 0.1
XOR_ONLY_ABOVE = 0.12
OVERWRITE_BELOW = 0.002
FEW_WORDS_BELOW = 0.25  # fraction of 8-byte words changed under which only those words are expanded
PREFERENCE = ("xor", "sparse", "overwrite")  # tie-break: the cheapest to decode first
_U32_LIMIT = 0xFFFFFFFF

ChunkChoices = dict[str, list[bytes]]


def encode_chunk_choices(spec: CodecSpec, old: np.ndarray, new: np.ndarray, itemsize: int) -> tuple[ChunkChoices, int]:
    """Candidate frames per encoding for one chunk of a ``mixed`` spec, and its changed byte count.

    An unchanged chunk returns ``({}, 0)``: empty frames in whichever encoding the tensor takes.
    """
    s = thread_scratch()
    found = _changes(old, new, itemsize, s)
    if found is None:  # too many changes for sparse to win: byte planes only
        return _xor_choice(spec, old, new, itemsize, s)
    positions, values = found
    count = positions.size
    if count == 0:
        return {}, 0
    density = count / (new.nbytes // values.itemsize)
    choices: ChunkChoices = {}
    if density <= XOR_ONLY_ABOVE:
        raw = sparse_raw(values, positions, s.get("sparse_raw", raw_bound(count, new.nbytes // values.itemsize, values.itemsize)))
        choices["sparse"] = [s.compress_sections(sparse_sections(raw))]
        if density <= OVERWRITE_BELOW:
            choices["overwrite"] = _overwrite_frames(spec, values, new, positions, itemsize, s)
    changed_bytes = int(np.count_nonzero(values.view(np.uint8)))
    if density >= SPARSE_ONLY_BELOW or not choices:
        choices["xor"] = _xor_choice(spec, old, new, itemsize, s)[0]["xor"]
    return choices, changed_bytes


def _changes(old: np.ndarray, new: np.ndarray, itemsize: int, s: ThreadScratch) -> tuple[np.ndarray, np.ndarray] | None:
    """(positions, XOR values) of the changed elements; ``None`` when the chunk is too dense for sparse."""
    k = element_size(itemsize)
    if new.nbytes > _U32_LIMIT:
        return None
    if k < 8 and new.nbytes % 8 == 0:
        dense_words = 1 - (1 - XOR_ONLY_ABOVE) ** (8 // k)  # the fraction of changed words that density gives
        hit_mask = s.get("words", new.nbytes // 8).view(np.bool_)
        old_words, new_words = old.view("<u8"), new.view("<u8")
        sample = min(hit_mask.size, max(4096, hit_mask.size // 16))  # a dense chunk skips the full pass
        np.not_equal(old_words[:sample], new_words[:sample], out=hit_mask[:sample])
        if sample < hit_mask.size and np.count_nonzero(hit_mask[:sample]) > 1.2 * dense_words * sample:
            return None
        np.not_equal(old_words[sample:], new_words[sample:], out=hit_mask[sample:])
        hits = int(np.count_nonzero(hit_mask))
        if hits > dense_words * hit_mask.size:
            return None
        if hits < FEW_WORDS_BELOW * hit_mask.size:
            return changed_elements_few(old, new, itemsize, np.flatnonzero(hit_mask))
    return changed_elements(old, new, itemsize, s.get("elements", new.nbytes // k).view(np.bool_))


def _xor_choice(spec: CodecSpec, old: np.ndarray, new: np.ndarray, itemsize: int, s: ThreadScratch) -> tuple[ChunkChoices, int]:
    """The chunk as XOR byte planes (dense or bitmap planes): the only candidate of a dense chunk."""
    diff = s.get("xor", new.nbytes)
    np.bitwise_xor(old, new, out=diff)
    changed_bytes = int(np.count_nonzero(diff))
    if changed_bytes == 0:
        return {}, 0
    xor_spec = spec.for_tensor("xor")
    return {"xor": [compress_plane(xor_spec, p, s, allow_empty=True)
                    for p in byte_planes(diff, xor_spec.num_planes(itemsize), "x", s)]}, changed_bytes


def _overwrite_frames(spec: CodecSpec, values: np.ndarray, new: np.ndarray, positions: np.ndarray, itemsize: int,
                      s: ThreadScratch) -> list[bytes]:
    """The ``overwrite`` frames of a chunk (one per byte plane) from its changed elements."""
    k = values.itemsize
    num_planes = spec.for_tensor("overwrite").num_planes(itemsize)
    changed = values.view(np.uint8).reshape(-1, k) != 0  # (changes, k): which bytes of each element changed
    if num_planes == 2:
        per_plane = [positions[changed[:, j]] for j in range(2)]
        values = [new.reshape(-1, 2)[p, j] for j, p in enumerate(per_plane)]
    else:
        byte_positions = (positions[:, None] * k + np.arange(k))[changed]
        per_plane, values = [byte_positions], [new[byte_positions]]
    frames = []
    for plane_positions, plane_values in zip(per_plane, values):
        if plane_positions.size == 0:
            frames.append(b"")
            continue
        raw = np.uint32(plane_positions.size).astype("<u4").tobytes() + plane_positions.astype("<u4").tobytes() \
            + plane_values.tobytes()
        frames.append(s.checked.compress(raw))
    return frames


def choose_encoding(chunks: list[tuple[ChunkChoices, int]]) -> str | None:
    """The encoding a tensor takes from its chunks' candidates (``None``: no chunk changed;
    ``""``: no encoding common to every changed chunk)."""
    changed = [c for c, _ in chunks if c]
    if not changed:
        return None
    common = set(changed[0]).intersection(*changed[1:])
    if not common:
        return ""
    size = {e: sum(len(f) for c in changed for f in c[e]) for e in common}
    return min(sorted(common, key=PREFERENCE.index), key=size.__getitem__)
