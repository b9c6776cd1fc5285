"""The codecs ``bench delta`` times, as objects with the same encode/decode/reset/exact phases.

* :class:`Ours`: this project's default codec (``mixed``: per tensor the smallest of XOR byte planes,
  sparse gap-coded positions + XOR values, and overwrite; 4 MiB chunks, zstd-1, xxh3-128), decoding
  into place;
* :class:`Reference`: XOR + zstd level 1 per whole tensor, no filter (the plain disk-delta format),
  a thread pool over tensors.

Every codec runs its tensors over the thread pool it is given; :meth:`Codec.timed_round` times one
encode and one decode (from the old weights again), keeping the best round. Also here: the order-0
entropy bound both ``bench delta`` and ``bench delta --densities`` print beside the codecs.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

BENCH_CHECKSUM = "xxh3-128"


def best_s(fn: Callable[[], object], repeat: int, setup: Callable[[], None] | None = None) -> float:
    """The fastest of ``repeat`` (at least one) timed calls of ``fn``, ``setup`` run untimed before each."""
    best = float("inf")
    for _ in range(max(1, repeat)):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def entropy_bound_bytes(old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> int:
    """Order-0 entropy of the XOR low and high byte planes (bf16), in bytes."""
    hist = np.zeros((2, 256), dtype=np.int64)
    for name in old:
        diff = (old[name] ^ new[name]).reshape(-1, 2)
        for plane in range(2):
            hist[plane] += np.bincount(diff[:, plane], minlength=256)
    bits = 0.0
    for counts in hist:
        p = counts[counts > 0] / counts.sum()
        bits += float(-(p * np.log2(p)).sum()) * counts.sum()
    return int(math.ceil(bits / 8))


class Codec:
    """One codec's encode/decode phases, timed over interleaved rounds (best round wins).

    Subclasses implement ``encode`` (sets ``wire_bytes``), ``reset`` (back to the old weights),
    ``decode`` and ``exact`` (whether the decoded weights equal the new ones)."""

    def __init__(self, pool: ThreadPoolExecutor, old: dict[str, np.ndarray], new: dict[str, np.ndarray]):
        self.pool, self.old, self.new = pool, old, new
        self.total = sum(a.nbytes for a in new.values())
        self.encode_s = self.decode_s = float("inf")
        self.wire_bytes = 0

    def timed_round(self) -> None:
        self.encode_s = min(self.encode_s, best_s(self.encode, 1))
        self.decode_s = min(self.decode_s, best_s(self.decode, 1, setup=self.reset))

    def report(self) -> dict[str, float]:
        return {"wire_bytes": self.wire_bytes, "encode_gbps": self.total / self.encode_s / 1e9,
                "decode_gbps": self.total / self.decode_s / 1e9}

    def encode(self) -> None: ...
    def decode(self) -> None: ...
    def reset(self) -> None: ...
    def exact(self) -> bool: ...


class Ours(Codec):
    """The default codec: XOR, byte planes (dense or sparse), 4 MiB chunks, zstd-1, xxh3-128."""

    def __init__(self, *args, itemsizes: dict[str, int] | None = None):
        """``itemsizes``: bytes per element of each tensor (default 2: bf16 everywhere)."""
        from miles_disagg.weights.codec import publish_spec

        super().__init__(*args)
        self.itemsizes = itemsizes or {}
        self.spec = publish_spec("xor", "byteplane")
        self.encoded: list = []
        self.targets = {n: np.empty_like(a) for n, a in self.old.items()}

    def encode(self) -> None:
        from miles_disagg.weights.codec import encode_tensors

        items = ((n, self.old[n], self.new[n], self.itemsizes.get(n, 2)) for n in self.new)
        self.encoded = [e for e in encode_tensors(self.pool, self.spec, BENCH_CHECKSUM, items) if e.payload is not None]
        self.wire_bytes = sum(len(e.payload) for e in self.encoded)

    def reset(self) -> None:
        for name, array in self.old.items():
            np.copyto(self.targets[name], array)

    def decode(self) -> None:
        from miles_disagg.weights.codec import decode_tensors

        items = ((e.name, self.targets[e.name], memoryview(e.payload), self.itemsizes.get(e.name, 2), e.checksum)
                 for e in self.encoded)
        encodings = {e.name: e.encoding for e in self.encoded}
        for _ in decode_tensors(self.pool, self.spec, BENCH_CHECKSUM, items, encodings=encodings):
            pass

    def exact(self) -> bool:
        return all(np.array_equal(self.targets[n], self.new[n]) for n in self.new)


def _reference_encode_one(old: np.ndarray, new: np.ndarray) -> tuple[bytes | None, int, str]:
    import zstandard

    from miles_disagg.weights.checksums import checksum

    diff = new ^ old
    changed = int(np.count_nonzero(diff))
    if not changed:
        return None, 0, ""
    return zstandard.ZstdCompressor(level=1).compress(diff), changed, checksum(BENCH_CHECKSUM, new)


def _reference_decode_one(old: np.ndarray, payload: bytes, expected: str) -> np.ndarray:
    import zstandard

    from miles_disagg.weights.checksums import checksum

    new = old ^ np.frombuffer(zstandard.ZstdDecompressor().decompress(payload), dtype=np.uint8)
    if checksum(BENCH_CHECKSUM, new) != expected:
        raise RuntimeError("reference codec round trip failed")
    return new


class Reference(Codec):
    """XOR + zstd level 1 per whole tensor, no filter; a thread pool over tensors."""

    def __init__(self, *args):
        super().__init__(*args)
        self.encoded: dict[str, tuple[bytes | None, int, str]] = {}
        self.results: dict[str, np.ndarray] = {}

    def encode(self) -> None:
        names = list(self.new)
        encoded = self.pool.map(lambda n: _reference_encode_one(self.old[n], self.new[n]), names)
        self.encoded = dict(zip(names, encoded))
        self.wire_bytes = sum(len(p) for p, _, _ in self.encoded.values() if p is not None)

    def reset(self) -> None:
        self.results = {}

    def decode(self) -> None:
        changed = [n for n, (p, _, _) in self.encoded.items() if p is not None]
        decoded = self.pool.map(lambda n: _reference_decode_one(self.old[n], self.encoded[n][0], self.encoded[n][2]),
                                changed)
        self.results = dict(zip(changed, decoded))

    def exact(self) -> bool:
        return all(np.array_equal(self.results.get(n, self.old[n]), self.new[n]) for n in self.new)
