"""Applying one published version onto tensor bytes (a checkpoint's files or RAM buffers).

``load_payloads`` validates a version directory's payload files against its index before
anything is applied: every mapped tensor present as a 1-D uint8 payload with a checksum,
no missing or truncated file. ``apply_version`` then decodes and verifies each changed
tensor's final bytes; targets are the caller's scratch copies, so a failure part-way
leaves nothing the caller cannot discard.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection, Iterator, Mapping

import numpy as np

from miles_disagg.types import FormatError, LayoutMismatch
from miles_disagg.weights.codec import decode_tensors
from miles_disagg.weights.format import VersionIndex
from miles_disagg.weights.safetensors_io import read_bytes, read_header


@dataclass(frozen=True)
class LocalTensor:
    """Layout of a tensor the host holds: what a delta must agree with."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    itemsize: int


@dataclass(frozen=True)
class Payload:
    data: memoryview
    checksum: str


def load_payloads(version_dir: Path, index: VersionIndex, pool: ThreadPoolExecutor | None = None,
                  names: Collection[str] | None = None) -> dict[str, Payload]:
    """Read and validate the payloads of a version (of ``names`` only, when given: a rank's share);
    ``FormatError`` on any malformed file. The files of a version (one or more per writing rank)
    are read in parallel over ``pool``."""
    wanted = set(index.weight_map) if names is None else set(names) & set(index.weight_map)
    files = sorted({index.weight_map[n] for n in wanted})
    if pool is None or len(files) < 2:
        parts = [_load_file(version_dir, index, f, wanted) for f in files]
    else:
        parts = list(pool.map(lambda f: _load_file(version_dir, index, f, wanted), files))
    return {name: payload for part in parts for name, payload in part.items()}


def _load_file(version_dir: Path, index: VersionIndex, file_name: str, wanted: set[str]) -> dict[str, Payload]:
    header = read_header(version_dir / file_name)
    mapped = {n for n, f in index.weight_map.items() if f == file_name}
    if set(header.tensors) != mapped:
        raise FormatError(
            f"{version_dir.name}/{file_name} holds {sorted(header.tensors)}, the index maps {sorted(mapped)} to it"
        )
    payloads: dict[str, Payload] = {}
    for name in sorted(mapped):
        entry = header.tensors[name]
        if entry.dtype != "U8" or len(entry.shape) != 1:
            raise FormatError(f"{version_dir.name}/{file_name}: payload {name!r} is not a 1-D uint8 tensor")
        digest = header.metadata.get(name)
        if not digest:
            raise FormatError(f"{version_dir.name}/{file_name}: no checksum for tensor {name!r} in __metadata__")
        if name in wanted:
            payloads[name] = Payload(memoryview(read_bytes(header.path, entry)), digest)
    return payloads


def check_layouts(index: VersionIndex, local: Mapping[str, LocalTensor], where: str,
                  names: Collection[str] | None = None) -> None:
    """Every changed tensor (of ``names``, when given) exists locally with the dtype/shape/size the
    version declares."""
    for name in (index.weight_map if names is None else set(names) & set(index.weight_map)):
        have = local.get(name)
        if have is None:
            raise LayoutMismatch(f"{where} changes tensor {name!r}, which the local checkpoint does not have")
        want = index.layouts.get(name)
        if want is not None and (want.dtype, tuple(want.shape), want.nbytes) != (have.dtype, have.shape, have.nbytes):
            raise LayoutMismatch(
                f"{where}: tensor {name!r} is {want.dtype}{list(want.shape)} ({want.nbytes} bytes) in the version "
                f"but {have.dtype}{list(have.shape)} ({have.nbytes} bytes) locally"
            )


def apply_version(pool: ThreadPoolExecutor, version_dir: Path, index: VersionIndex,
                  local: Mapping[str, LocalTensor], target_of: Callable[[str], np.ndarray],
                  names: Collection[str] | None = None) -> Iterator[str]:
    """Apply ``index``'s deltas (to ``names`` only, when given) onto ``target_of(name)`` buffers in
    place; yield each verified name.

    Validates layouts and payload files up front (the files read in parallel), then decodes
    tensors and their chunks in parallel. Raises ``LayoutMismatch``, ``FormatError`` or
    ``ChecksumMismatch``.
    """
    where = f"version {index.version} ({version_dir})"
    check_layouts(index, local, where, names)
    payloads = load_payloads(version_dir, index, pool, names)
    items = (
        (name, target_of(name), payloads[name].data, local[name].itemsize, payloads[name].checksum)
        for name in sorted(payloads)
    )
    yield from decode_tensors(pool, index.codec, index.checksum_format, items, encodings=index.encodings)
