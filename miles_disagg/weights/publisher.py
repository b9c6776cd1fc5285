"""Trainer side: diff named HF tensors against a CPU snapshot and publish the next version.

Lifecycle: ``capture_baseline()`` reads ``base_dir`` (the ``--hf-checkpoint``) into a
CPU snapshot and catches up with this run's versions already in the store; it
publishes nothing. Each ``publish(named_tensors)`` streams the tensors (one at a time,
diffed and compressed over a thread pool), writes the changed ones into a staging
directory, fsyncs it and commits it (rename, post-write hook, ``LATEST``). The snapshot
advances only after the commit succeeded, so a failed publish can be retried from the
same state. Unchanged tensors are not published.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from miles_disagg.types import ConfigError, InvalidInput, LayoutMismatch, VersionRef, same_run
from miles_disagg.weights.apply import LocalTensor, apply_version
from miles_disagg.weights.checksums import CHECKSUMS
from miles_disagg.weights.codec import (
    COMPRESSIONS, DEFAULT_CHUNK_BYTES, FILTERS, PUBLISH_ENCODINGS, CodecSpec, EncodedTensor, encode_tensors, publish_spec,
)
from miles_disagg.weights.format import INDEX_NAME, TensorLayout, VersionIndex
from miles_disagg.weights.hooks import POST_WRITE_FLAG, load_hook
from miles_disagg.weights.safetensors_io import checkpoint_tensors, fsync_dir, read_bytes, write_file
from miles_disagg.weights.store import VersionStore

DEFAULT_SHARD_BYTES = 1 << 30
ENCODING_FLAG = "--update-weight-delta-encoding"
CHECKSUM_FLAG = "--update-weight-delta-checksum"
FILTER_FLAG = "--update-weight-delta-filter"
ANCHOR_FLAG = "--update-weight-full-anchor-interval"
STORE_FLAG = "--update-weight-disk-dir"


@dataclass(frozen=True)
class PublishResult:
    ref: VersionRef
    density: float  # changed bytes / total bytes
    wire_bytes: int  # bytes of the payload files written
    changed_bytes: int
    total_bytes: int
    num_changed_tensors: int
    encode_time_s: float  # diff + compress + checksum (includes pulling tensors from the iterable)
    publish_time_s: float  # write + fsync + commit (hook and pointer included)
    delta_encoding: str = "xor"

    def metrics(self) -> dict[str, float]:
        """The publish phase's record (the reference page's update metrics)."""
        return {"perf/update_weights_encode_time": self.encode_time_s,
                "perf/update_weights_publish_time": self.publish_time_s,
                "perf/update_weights_density": self.density,
                "perf/update_weights_wire_bytes": self.wire_bytes,
                "perf/update_weights_total_bytes": self.total_bytes,
                "weights/version": self.ref.version}


def check_codec_choices(encoding: str, checksum: str, filter: str) -> None:
    """``ConfigError`` naming the flag for an unknown encoding, checksum or filter."""
    for value, known, flag in ((encoding, PUBLISH_ENCODINGS, ENCODING_FLAG), (checksum, CHECKSUMS, CHECKSUM_FLAG),
                               (filter, FILTERS, FILTER_FLAG)):
        if value not in known:
            raise ConfigError(f"{flag}: unknown value {value!r} (choose from {', '.join(known)})", flags=(flag,))


@dataclass(frozen=True)
class FilterChoice:
    """The pre-compression filter a run publishes with, and why (logged; recorded in every index)."""

    filter: str
    reason: str


def choose_delta_filter(requested: str, consumers: list[tuple[str, list[str] | None]]) -> FilterChoice:
    """Resolve ``--update-weight-delta-filter`` for the consumers of the store.

    ``consumers``: ``(description, filters it announces)`` per consumer; ``None`` for one that
    announces nothing (stock SGLang, a foreign engine, a rollout service). ``auto`` picks
    ``byteplane`` only when every consumer announces it (this project's engines and agents do),
    else the plain format (``none``) that every disk-delta reader understands.
    """
    if requested != "auto":
        return FilterChoice(requested, f"{FILTER_FLAG} {requested}")
    if not consumers:
        return FilterChoice("none", "auto: no consumer known, so the plain format every reader understands")
    foreign = [name for name, announced in consumers if not announced or "byteplane" not in announced]
    if foreign:
        return FilterChoice("none", f"auto: {', '.join(foreign)} may not read byte planes, so the plain format")
    return FilterChoice("byteplane", f"auto: every consumer ({len(consumers)}) announces byte planes")


class DeltaPublisher:
    """Publishes versions of one run onto a store; one ``publish`` at a time."""

    def __init__(self, store_dir: str | Path, *, base_dir: str | Path, run_id: str | None = None,
                 encoding: str = "xor", checksum: str = "xxh3-128", filter: str = "byteplane",
                 post_write_hook: str | Callable[..., Any] | None = None, full_anchor_interval: int = 0,
                 num_workers: int = 2, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, prune_on_anchor: bool = True, reset_store: bool = False):
        check_codec_choices(encoding, checksum, filter)
        if not isinstance(full_anchor_interval, int) or full_anchor_interval < 0:
            raise ConfigError(f"{ANCHOR_FLAG} must be an integer >= 0, got {full_anchor_interval!r}", flags=(ANCHOR_FLAG,))
        self.store = VersionStore(store_dir)
        self.base_dir = Path(base_dir)
        self.run_id = run_id
        self.encoding, self.checksum, self.filter = encoding, checksum, filter
        self.full_anchor_interval = full_anchor_interval
        self.chunk_bytes, self.shard_bytes = chunk_bytes, shard_bytes
        self.prune_on_anchor, self.reset_store = prune_on_anchor, reset_store
        self._post_write = load_hook(post_write_hook, POST_WRITE_FLAG)
        self._pool = ThreadPoolExecutor(max(1, num_workers), thread_name_prefix="publish")
        self._snapshot: dict[str, np.ndarray] | None = None
        self._layouts: dict[str, LocalTensor] = {}
        self._latest: VersionRef | None = None
        self._publish_lock = threading.Lock()

    @property
    def tensor_names(self) -> frozenset[str]:
        """Names of the baseline's tensors (empty before ``capture_baseline``)."""
        return frozenset(self._layouts)

    def set_filter(self, filter: str) -> None:
        """The filter of every later version (a run resolves ``auto`` once its engines are known)."""
        check_codec_choices(self.encoding, self.checksum, filter)
        with self._publish_lock:
            self.filter = filter

    def published_checksums(self, algorithm: str | None = None) -> dict[str, str]:
        """Checksums of every tensor of the last published (or baseline) state, keyed by HF name:
        what an engine serving ``latest`` must hold, byte for byte."""
        from miles_disagg.weights.checksums import checksum

        if self._snapshot is None:
            raise InvalidInput("capture_baseline() must run before published_checksums()")
        with self._publish_lock:
            return {name: checksum(algorithm or self.checksum, data) for name, data in self._snapshot.items()}

    @property
    def latest(self) -> VersionRef | None:
        """The last version this publisher committed or caught up with."""
        return self._latest

    def capture_baseline(self) -> None:
        """Snapshot ``base_dir`` (and this run's published versions, if any); publish nothing."""
        latest = self.store.latest()
        if latest is not None and self.run_id is not None and not same_run(latest.run_id, self.run_id):
            if not self.reset_store:
                raise ConfigError(
                    f"{STORE_FLAG} {self.store.root} holds run {latest.run_id!r} (at v{latest.version}); "
                    f"this run is {self.run_id!r}: use another directory or reset it",
                    flags=(STORE_FLAG,),
                )
            self.store.reset()
            latest = None
        if self.run_id is None:
            self.run_id = latest.run_id if latest is not None else uuid.uuid4().hex[:12]
        snapshot, layouts = {}, {}
        for name, (file_name, entry) in checkpoint_tensors(self.base_dir).items():
            snapshot[name] = np.frombuffer(read_bytes(self.base_dir / file_name, entry), dtype=np.uint8)
            layouts[name] = LocalTensor(entry.dtype, entry.shape, entry.nbytes, entry.itemsize)
        if latest is not None and latest.version > 0:
            plan = self.store.plan_chain(latest.version, VersionRef(latest.run_id, 0))
            for index in plan.versions:
                for _ in apply_version(self._pool, self.store.version_dir(index.version), index, layouts, snapshot.__getitem__):
                    pass
        self._snapshot, self._layouts, self._latest = snapshot, layouts, latest

    def publish(self, named_tensors: Iterable[tuple[str, Any]], *, full: bool = False) -> PublishResult:
        """Publish the next version from ``(hf_name, tensor)`` pairs (streamed, one at a time).

        Raises ``LayoutMismatch`` for an unknown name or a dtype/shape that differs from the
        baseline, ``PublishConflict`` when another publisher moved the pointer, and whatever
        the post-write hook raises; in every case the pointer and the snapshot are unchanged.

        ``full=True`` publishes a ``full`` anchor (every tensor whole) whatever the interval:
        a resumed trainer whose state differs from the store's newest version uses it so every
        host converges onto what the trainer holds.
        """
        with self._publish_lock:
            return self._publish(named_tensors, full)

    def _publish(self, named_tensors: Iterable[tuple[str, Any]], force_full: bool = False) -> PublishResult:
        if self._snapshot is None:
            raise InvalidInput("capture_baseline() must run before publish()")
        start = time.perf_counter()
        version = (self._latest.version if self._latest else 0) + 1
        anchor = force_full or (self.full_anchor_interval > 0 and version % self.full_anchor_interval == 0)
        spec = publish_spec(self.encoding, self.filter, self.chunk_bytes, anchor)
        new_bytes: dict[str, np.ndarray] = {}
        encoded: list[EncodedTensor] = []
        total = 0
        for result in encode_tensors(self._pool, spec, self.checksum, self._items(named_tensors, new_bytes, anchor)):
            total += result.nbytes
            if result.payload is None:
                new_bytes.pop(result.name, None)
            else:
                encoded.append(result)
        encode_s = time.perf_counter() - start
        ref = VersionRef(self.run_id or "", version)
        wire = self._write_and_commit(ref, spec, encoded, total)
        for name, data in new_bytes.items():
            self._snapshot[name] = data
        self._latest = ref
        if anchor and self.prune_on_anchor:
            self.store.prune()
        changed = sum(e.changed_bytes for e in encoded)
        return PublishResult(ref, changed / max(total, 1), wire, changed, total, len(encoded), encode_s,
                             time.perf_counter() - start - encode_s, spec.encoding)

    def _items(self, named_tensors: Iterable[tuple[str, Any]], new_bytes: dict[str, np.ndarray],
               anchor: bool) -> Iterator[tuple[str, np.ndarray, np.ndarray, int]]:
        from miles_disagg.weights.torch_bytes import dtype_code, tensor_bytes

        assert self._snapshot is not None
        seen: set[str] = set()
        for name, tensor in named_tensors:
            layout = self._layouts.get(name)
            if layout is None:
                raise LayoutMismatch(f"tensor {name!r} is not in the baseline checkpoint {self.base_dir}")
            if name in seen:
                raise InvalidInput(f"tensor {name!r} was given twice in one publish")
            seen.add(name)
            got = (dtype_code(tensor.dtype), tuple(tensor.shape))
            if got != (layout.dtype, layout.shape):
                raise LayoutMismatch(f"tensor {name!r} is {got[0]}{list(got[1])}, the baseline has {layout.dtype}{list(layout.shape)}")
            new_bytes[name] = tensor_bytes(tensor).copy()  # the caller may reuse its buffer
            yield name, self._snapshot[name], new_bytes[name], layout.itemsize
        if anchor:  # an anchor holds every tensor, also those the caller did not send
            for name in sorted(self._snapshot.keys() - seen):
                yield name, self._snapshot[name], self._snapshot[name], self._layouts[name].itemsize

    def _write_and_commit(self, ref: VersionRef, spec: CodecSpec, encoded: list[EncodedTensor], total: int) -> int:
        staging = self.store.new_staging_dir(ref.version)
        try:
            shards = _shard(encoded, self.shard_bytes)
            weight_map, wire = {}, 0
            for i, shard in enumerate(shards):
                file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                tensors = {e.name: ("U8", (len(e.payload),), e.payload) for e in shard}  # type: ignore[arg-type]
                wire += write_file(staging / file_name, tensors, {e.name: e.checksum for e in shard})
                weight_map.update({e.name: file_name for e in shard})
            index = VersionIndex(
                version=ref.version, base_version=ref.version - 1, run_id=ref.run_id,
                delta_encoding=spec.encoding, compression_format=COMPRESSIONS[0], checksum_format=self.checksum,
                filter=spec.filter, chunk_bytes=spec.chunk_bytes, weight_map=weight_map,
                layouts={e.name: _tensor_layout(self._layouts[e.name], e.encoding) for e in encoded},
                extra={"changed_bytes": str(sum(e.changed_bytes for e in encoded)), "total_bytes": str(total),
                       "created_unix": f"{time.time():.3f}"},
            )
            _write_json(staging / INDEX_NAME, index.to_json())
            fsync_dir(staging)
        except BaseException:
            import shutil

            shutil.rmtree(staging, ignore_errors=True)
            self.store.release_staging(staging)
            raise
        self.store.commit(staging, ref, self._latest, self._post_write)
        return wire

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _tensor_layout(layout: LocalTensor, encoding: str = "") -> TensorLayout:
    return TensorLayout(layout.dtype, layout.shape, layout.nbytes, encoding)


def _shard(encoded: list[EncodedTensor], shard_bytes: int) -> list[list[EncodedTensor]]:
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


def _write_json(path: Path, obj: Any) -> None:
    import json
    import os

    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
