"""Sharded publication, the rank side: which tensors a rank owns, and writing its share.

A version is written by every rank that owns part of the HF tensors. Each rank encodes its
share against its own share of the snapshot and writes it into the version's staging
directory as safetensors files of its own (``rank-NNNNN-MMMMM.safetensors``, fsynced), then
reports a :class:`ShareManifest`: what it wrote, per tensor. The committing rank
(:mod:`miles_disagg.weights.commit`) gives the files their final names and writes the one
index. Manifests are plain picklable data: they cross torch.distributed and Ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from miles_disagg.weights.apply import LocalTensor
from miles_disagg.weights.codec import EncodedTensor
from miles_disagg.weights.format import TensorLayout
from miles_disagg.weights.safetensors_io import write_file

SHARE_FILE_PREFIX = "rank-"


def assign_by_size(sizes: Mapping[str, int], num_ranks: int) -> list[frozenset[str]]:
    """Split tensors over ``num_ranks`` so each rank's bytes are about equal: largest first, each
    to the rank with the fewest bytes so far (ties: the lower rank). Deterministic: every rank
    computes the same split from the same sizes, with no communication."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    totals = [0] * num_ranks
    members: list[set[str]] = [set() for _ in range(num_ranks)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = min(range(num_ranks), key=lambda r: (totals[r], r))
        members[rank].add(name)
        totals[rank] += sizes[name]
    return [frozenset(m) for m in members]


@dataclass(frozen=True)
class ShareTensor:
    """One changed tensor of a share: where its payload is and what the index records of it."""

    name: str
    file_name: str  # the rank's own file in the staging dir (renamed at commit)
    checksum: str
    layout: TensorLayout
    changed_bytes: int


@dataclass(frozen=True)
class ShareManifest:
    """What one rank wrote for a version (or why it could not: ``error``)."""

    rank: int
    tensors: tuple[ShareTensor, ...] = ()
    files: tuple[str, ...] = ()
    wire_bytes: int = 0
    total_bytes: int = 0  # bytes of every tensor of the share (changed or not)
    snapshot_bytes: int = 0  # what the rank's CPU snapshot holds
    encode_time_s: float = 0.0
    write_time_s: float = 0.0
    error: str = ""  # non-empty: this rank failed; nothing of the version may commit
    objects: tuple[Any, ...] = ()  # what the store took of the files at once (an object store: uploaded)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def changed_bytes(self) -> int:
        return sum(t.changed_bytes for t in self.tensors)


def index_layout(encoded: EncodedTensor, local: LocalTensor) -> TensorLayout:
    """The index's record of one encoded tensor (the ONE place index layouts are built from
    encoded tensors: per-tensor codec choices belong here)."""
    return TensorLayout(local.dtype, local.shape, local.nbytes, encoded.encoding)


def share_file_name(rank: int, part: int) -> str:
    return f"{SHARE_FILE_PREFIX}{rank:05d}-{part:05d}.safetensors"


def write_share(staging: Path, rank: int, encoded: list[EncodedTensor], layouts: Mapping[str, LocalTensor],
                shard_bytes: int) -> tuple[tuple[ShareTensor, ...], tuple[str, ...], int]:
    """Write a rank's changed tensors into ``staging`` (files of at most ~``shard_bytes``, each
    fsynced before this returns): ``(tensors, files, wire bytes)``."""
    tensors: list[ShareTensor] = []
    files: list[str] = []
    wire = 0
    for part, group in enumerate(split_into_files(encoded, shard_bytes)):
        file_name = share_file_name(rank, part)
        payloads = {e.name: ("U8", (len(e.payload),), e.payload) for e in group}  # type: ignore[arg-type]
        wire += write_file(staging / file_name, payloads, {e.name: e.checksum for e in group})
        files.append(file_name)
        tensors += [ShareTensor(e.name, file_name, e.checksum, index_layout(e, layouts[e.name]), e.changed_bytes)
                    for e in group]
    return tuple(tensors), tuple(files), wire


def split_into_files(encoded: list[EncodedTensor], shard_bytes: int) -> list[list[EncodedTensor]]:
    """Consecutive groups of about ``shard_bytes`` of payload (a bigger tensor gets a file of its own)."""
    shards: list[list[EncodedTensor]] = []
    size = 0
    for item in encoded:
        n = len(item.payload or b"")
        if not shards or size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += n
    return shards
