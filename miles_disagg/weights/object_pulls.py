"""Pulling a version's objects: each checked against its manifest entry, several side by side, and
what the pulls moved counted by source (the object store, the region's relay, the relay's own
pulls across the WAN)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

from miles_disagg.types import ChecksumMismatch, FormatError
from miles_disagg.weights.checksums import new_hasher
from miles_disagg.weights.object_layout import OBJECT_CHECKSUM, StoredObject

HASH_BYTES = 4 * 1024 * 1024
OBJECTS_IN_FLIGHT = 4  # objects of one version pulled at once (each in parallel ranges of its own)


def file_checksum(path: Path) -> tuple[int, str]:
    """``(size, xxh3-128)`` of a file, read in bounded pieces."""
    hasher, size = new_hasher(OBJECT_CHECKSUM), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_BYTES):
            hasher.update(chunk)
            size += len(chunk)
    return size, hasher.hexdigest()


class TransferStats:
    """Bytes a store's pulls moved: straight from the object store, from the region's relay (and of
    those, what the relay itself pulled across the WAN for them), and relay fallbacks."""

    FIELDS = ("store_bytes", "relay_bytes", "relay_wan_bytes", "relay_fallbacks")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                self._counts[name] += value

    def snapshot(self) -> dict[str, int]:
        """The counts, plus ``wan_bytes``: what crossed the WAN for these pulls (direct + the relay's)."""
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "wan_bytes": counts["store_bytes"] + counts["relay_wan_bytes"]}


def pull_all(pulls: Sequence[Callable[[], None]], concurrency: int = OBJECTS_IN_FLIGHT) -> None:
    """Run ``pulls`` (callables) a few at a time, so a version's objects share the link (and a relay
    pulls them side by side); the first failure is raised once every pull started has ended."""
    if len(pulls) <= 1:
        for pull in pulls:
            pull()
        return
    with ThreadPoolExecutor(min(concurrency, len(pulls)), thread_name_prefix="s3-object") as pool:
        futures = [pool.submit(pull) for pull in pulls]
        errors = [f.exception() for f in futures]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first


def check_object(path: Path, size: int, expected: StoredObject, where: str, name: str) -> None:
    if size < 0:
        raise FormatError(f"{where} is missing (the manifest names it)")
    if size != expected.nbytes:
        raise FormatError(f"{where} is {size} bytes, the manifest says {expected.nbytes}")
    _, digest = file_checksum(path)
    if digest != expected.checksum:
        raise ChecksumMismatch(name, expected.checksum, digest, OBJECT_CHECKSUM)
