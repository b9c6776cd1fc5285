"""Sharded publication, the commit side: how the ranks agree, and the one commit of a version.

Protocol of one publish over ``world_size`` ranks (every rank calls it; rank 0 commits):

1. rank 0 makes the staging directory (owned by its ``flock``) and broadcasts its path;
2. every rank encodes and writes its share there, fsyncs its files, and reports a
   :class:`~miles_disagg.weights.shares.ShareManifest` (gathered on rank 0);
3. rank 0, once every share is durable, renames the files to ``model-{i:05d}-of-{n:05d}``,
   writes the one index, fsyncs the directory and commits it (rename, post-write hook once,
   ``LATEST``); any rank's failure instead removes the staging directory;
4. rank 0 broadcasts the outcome, so every rank advances its snapshot, or none does.

A rank that dies before step 4 leaves no visible version: the pointer never moved, and the
staging directory (or an orphan version directory above the pointer) is swept by the next
commit, or at once when the committing rank dies (its ``flock`` is released).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Sequence

from miles_disagg.types import FailRun, VersionRef
from miles_disagg.weights.format import COMPRESSIONS, INDEX_NAME, CodecSpec, VersionIndex
from miles_disagg.weights.store import PostWriteHook, VersionStore
from miles_disagg.weights.safetensors_io import fsync_dir
from miles_disagg.weights.shares import ShareManifest


class ShareFailed(FailRun):
    """Another rank could not write its share (or the commit failed); no version was committed."""


class Collective(Protocol):
    """The ranks publishing one version together (torch.distributed, or one rank alone)."""

    rank: int
    world_size: int

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (rank order); ``None`` elsewhere."""


class SingleRank:
    """The collective of a publisher that writes every tensor itself."""

    rank, world_size = 0, 1

    def broadcast(self, obj: Any) -> Any:
        return obj

    def gather(self, obj: Any) -> list[Any]:
        return [obj]


class TorchCollective:
    """Over torch.distributed: a gloo group of its own (objects travel on the CPU whatever the
    training backend is). Creating it is collective over every rank of the default group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self._group = dist.new_group(backend="gloo")

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        self._dist.gather_object(obj, out, dst=0, group=self._group)
        return out


@dataclass(frozen=True)
class CommitInfo:
    wire_bytes: int
    num_files: int
    commit_time_s: float  # rename files + index + fsync + store commit (hook and pointer)


def commit_shares(store: VersionStore, staging: Path, ref: VersionRef, expected: VersionRef | None,
                  manifests: Sequence[ShareManifest], spec: CodecSpec, checksum_format: str,
                  post_write_hook: PostWriteHook | None) -> CommitInfo:
    """Rank 0: turn the durable shares in ``staging`` into version ``ref`` (see the module
    docstring). On failure the staging directory is gone and the pointer unchanged."""
    start = time.perf_counter()
    try:
        failed = [m for m in manifests if m.error]
        if failed:
            raise ShareFailed("; ".join(f"rank {m.rank}: {m.error}" for m in failed))
        index = _rename_and_index(staging, ref, manifests, spec, checksum_format, store.renames_share_files)
        _write_json(staging / INDEX_NAME, index.to_json())
        fsync_dir(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        store.release_staging(staging)
        raise
    store.commit(staging, ref, expected, post_write_hook, objects=[o for m in manifests for o in m.objects])
    return CommitInfo(sum(m.wire_bytes for m in manifests), len(index.files()), time.perf_counter() - start)


def _rename_and_index(staging: Path, ref: VersionRef, manifests: Sequence[ShareManifest], spec: CodecSpec,
                      checksum_format: str, rename: bool) -> VersionIndex:
    """Final file names (rank order, then each rank's order) and the index naming them (a store
    that took the files as written, ``rename`` False, keeps the ranks' own names)."""
    files = [f for m in sorted(manifests, key=lambda m: m.rank) for f in m.files]
    final = {f: f"model-{i:05d}-of-{len(files):05d}.safetensors" if rename else f for i, f in enumerate(files)}
    for old, new in final.items():
        if old != new:
            os.rename(staging / old, staging / new)
    tensors = [t for m in manifests for t in m.tensors]
    duplicate = len({t.name for t in tensors}) != len(tensors)
    if duplicate:
        raise ShareFailed("two ranks wrote the same tensor: the shares overlap")
    return VersionIndex(
        version=ref.version, base_version=ref.version - 1, run_id=ref.run_id, delta_encoding=spec.encoding,
        compression_format=COMPRESSIONS[0], checksum_format=checksum_format, filter=spec.filter,
        chunk_bytes=spec.chunk_bytes, weight_map={t.name: final[t.file_name] for t in tensors},
        layouts={t.name: t.layout for t in tensors},
        extra={"changed_bytes": str(sum(m.changed_bytes for m in manifests)),
               "total_bytes": str(sum(m.total_bytes for m in manifests)), "created_unix": f"{time.time():.3f}"},
    )


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
