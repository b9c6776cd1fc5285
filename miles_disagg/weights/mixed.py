"""The ``mixed`` delta encoding: per tensor, the smallest of XOR byte planes, sparse and overwrite.

A ``mixed`` version (byte-plane filter only) records in its index, per changed tensor, which of
``xor`` (XOR, byte planes, dense or bitmap+values planes), ``sparse`` (gap-coded positions + XOR
values, :mod:`miles_disagg.weights.sparse`) or ``overwrite`` (byte positions + new bytes) its payload
uses. Readers that do not know ``mixed`` refuse the version (unknown ``delta_encoding``) instead of
misreading a payload.

Each chunk is encoded in the forms that can win at its density (measured on the chunk itself):

* at most ``XOR_ONLY_ABOVE`` of its elements changed: ``sparse`` (finding the positions costs a
  pass that grows with the density; above that, byte planes are both smaller and faster);
* at least ``SPARSE_ONLY_BELOW``: ``xor`` byte planes (below it, sparse is always smaller);
* at most ``OVERWRITE_BELOW``: ``overwrite``, built from the sparse positions at O(changes).

Between the bounds both candidates are encoded and the smaller is kept, so the choice is exact
where the two are close. A tensor takes the encoding whose chunks sum smallest among those every
changed chunk produced; should its chunks disagree entirely (dense and sparse regions), the chunks
lacking ``xor`` are encoded as ``xor`` too.
"""

from __future__ import annotations

import numpy as np

from miles_disagg.weights.sparse import element_size, element_view, raw_bound, sparse_raw

SPARSE_ONLY_BELOW = 0.12
XOR_ONLY_ABOVE = 0.2
OVERWRITE_BELOW = 0.002
PREFERENCE = ("xor", "sparse", "overwrite")  # tie-break: the cheapest to decode first
_U32_LIMIT = 0xFFFFFFFF

ChunkChoices = dict[str, list[bytes]]


def encode_chunk_choices(spec, old: np.ndarray, new: np.ndarray, itemsize: int) -> tuple[ChunkChoices, int]:
    """Candidate frames per encoding for one chunk of a ``mixed`` spec, and its changed byte count.

    An unchanged chunk returns ``({}, 0)``: empty frames in whichever encoding the tensor takes.
    """
    from miles_disagg.weights.codec import _compress_plane, _local, _planes

    s = _local()
    diff = s.get("xor", new.nbytes)
    np.bitwise_xor(old, new, out=diff)
    words = element_view(diff, itemsize)
    mask = s.get("elements", words.size).view(np.bool_)
    np.not_equal(words, 0, out=mask)
    count = int(np.count_nonzero(mask))
    if count == 0:
        return {}, 0
    density = count / words.size
    choices: ChunkChoices = {}
    if density <= XOR_ONLY_ABOVE and new.nbytes <= _U32_LIMIT:
        positions = np.flatnonzero(mask)
        raw = sparse_raw(words, positions, s.get("sparse_raw", raw_bound(count, words.size, words.itemsize)))
        changed_bytes = int(np.count_nonzero(raw[raw.nbytes - count * words.itemsize:]))  # the value planes
        choices["sparse"] = [s.checked.compress(raw)]
        if density <= OVERWRITE_BELOW:
            choices["overwrite"] = _overwrite_frames(spec, diff, new, positions, itemsize, s)
    else:
        changed_bytes = int(np.count_nonzero(diff))
    if density >= SPARSE_ONLY_BELOW or not choices:
        xor_spec = spec.for_tensor("xor")
        choices["xor"] = [_compress_plane(xor_spec, p, s, allow_empty=True)
                          for p in _planes(diff, xor_spec.num_planes(itemsize), "x", s)]
    return choices, changed_bytes


def _overwrite_frames(spec, diff: np.ndarray, new: np.ndarray, positions: np.ndarray, itemsize: int, s) -> list[bytes]:
    """The ``overwrite`` frames of a chunk (one per byte plane) from its changed element positions."""
    k = element_size(itemsize)
    num_planes = spec.for_tensor("overwrite").num_planes(itemsize)
    changed = diff.reshape(-1, k)[positions] != 0  # (changes, k): which bytes of each element changed
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
