"""Final-state checksums of tensor bytes: ``xxh3-128`` (default), ``blake3``, ``adler32``.

Hex digests match what other disk-delta producers write (``adler32`` as 8 hex digits).
"""

from __future__ import annotations

import zlib
from typing import Any

CHECKSUMS = ("xxh3-128", "blake3", "adler32")
DEFAULT_CHECKSUM = "xxh3-128"


class _Adler32:
    """adler32 behind the ``update``/``hexdigest`` interface of the other hashers."""

    def __init__(self) -> None:
        self._value = 1

    def update(self, data: Any) -> None:
        self._value = zlib.adler32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(algorithm: str) -> Any:
    """An incremental hasher for ``algorithm``; ``KeyError`` for an unknown name."""
    if algorithm == "xxh3-128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm == "blake3":
        import blake3

        return blake3.blake3()
    if algorithm == "adler32":
        return _Adler32()
    raise KeyError(f"unknown checksum {algorithm!r} (known: {', '.join(CHECKSUMS)})")


def checksum(algorithm: str, data: Any) -> str:
    """Hex digest of ``data`` (any buffer) under ``algorithm``."""
    hasher = new_hasher(algorithm)
    hasher.update(memoryview(data).cast("B") if not isinstance(data, bytes) else data)
    return hasher.hexdigest()
