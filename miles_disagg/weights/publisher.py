"""Trainer side: diff named HF tensors against a CPU snapshot and publish the next version.

Lifecycle: ``capture_baseline()`` reads ``base_dir`` (the ``--hf-checkpoint``) into a
CPU snapshot and catches up with this run's versions already in the store; it
publishes nothing. Each ``publish(named_tensors)`` streams the tensors (one at a time,
diffed and compressed over a thread pool), writes the changed ones into a staging
directory, fsyncs it and commits it (rename, post-write hook, ``LATEST``). The snapshot
advances only after the commit succeeded, so a failed publish can be retried from the
same state. Unchanged tensors are not published.

Sharded (``share`` and ``collective`` given): one publisher per trainer rank, each owning a
share of the tensors: its snapshot (baseline and catch-up included) holds only that share,
it encodes and writes only that share, and rank 0 commits the version once every share is
durable (:mod:`miles_disagg.weights.shares`, :mod:`miles_disagg.weights.commit`). Tensors of
other shares given to ``publish`` are skipped.
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
from miles_disagg.weights.codec import PUBLISH_ENCODINGS, EncodedTensor, encode_tensors, publish_spec
from miles_disagg.weights.commit import Collective, ShareFailed, SingleRank, commit_shares
from miles_disagg.weights.format import DEFAULT_CHUNK_BYTES, FILTERS, CodecSpec
from miles_disagg.weights.hooks import POST_WRITE_FLAG, load_hook
from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes
from miles_disagg.weights.served_form import ServedForm
from miles_disagg.weights.shares import ShareManifest, write_share
from miles_disagg.weights.object_store import ObjectVersionStore
from miles_disagg.weights.stores import open_store

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
    snapshot_bytes: int = 0  # the largest CPU snapshot of a writing rank (its share)
    num_ranks: int = 1  # ranks that wrote a share
    commit_time_s: float = 0.0  # rank 0's part after every share was durable: index, fsync, commit
    max_rank_wire_bytes: int = 0  # the largest share's payload bytes

    def metrics(self) -> dict[str, float]:
        """The publish phase's record (the reference page's update metrics)."""
        return {"perf/update_weights_encode_time": self.encode_time_s,
                "perf/update_weights_publish_time": self.publish_time_s,
                "perf/update_weights_density": self.density,
                "perf/update_weights_wire_bytes": self.wire_bytes,
                "perf/update_weights_total_bytes": self.total_bytes,
                "perf/update_weights_snapshot_bytes": self.snapshot_bytes,
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
    """Publishes versions of one run onto a store; one ``publish`` at a time (per rank)."""

    def __init__(self, store_dir: str | Path, *, base_dir: str | Path, run_id: str | None = None,
                 encoding: str = "xor", checksum: str = "xxh3-128", filter: str = "byteplane",
                 post_write_hook: str | Callable[..., Any] | None = None, full_anchor_interval: int = 0,
                 num_workers: int = 2, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, prune_on_anchor: bool = True, reset_store: bool = False,
                 base_in_store: bool = False, model_in_store: str | Path | None = None,
                 share: Iterable[str] | None = None, collective: Collective | None = None):
        check_codec_choices(encoding, checksum, filter)
        if not isinstance(full_anchor_interval, int) or full_anchor_interval < 0:
            raise ConfigError(f"{ANCHOR_FLAG} must be an integer >= 0, got {full_anchor_interval!r}", flags=(ANCHOR_FLAG,))
        self.store = open_store(store_dir, flag=STORE_FLAG)
        self.base_dir = Path(base_dir)
        self.run_id = run_id
        self.encoding, self.checksum, self.filter = encoding, checksum, filter
        self.full_anchor_interval = full_anchor_interval
        self.chunk_bytes, self.shard_bytes = chunk_bytes, shard_bytes
        self.prune_on_anchor, self.reset_store, self.base_in_store = prune_on_anchor, reset_store, base_in_store
        self.model_in_store = None if model_in_store is None else Path(model_in_store)
        self.share = None if share is None else frozenset(share)
        self.collective: Collective = collective or SingleRank()
        self._post_write = load_hook(post_write_hook, POST_WRITE_FLAG) if self.collective.rank == 0 else None
        self._pool = ThreadPoolExecutor(max(1, num_workers), thread_name_prefix="publish")
        self._snapshot: dict[str, np.ndarray] | None = None
        self._layouts: dict[str, LocalTensor] = {}  # every tensor of the checkpoint (all shares)
        self._served = ServedForm()  # what the engines serve: the trainer's tensors or their FP8 form
        self._latest: VersionRef | None = None
        self._publish_lock = threading.Lock()

    @property
    def tensor_names(self) -> frozenset[str]:
        """Names of the baseline's tensors, all shares (empty before ``capture_baseline``)."""
        return frozenset(self._layouts)

    @property
    def snapshot_bytes(self) -> int:
        """Bytes this rank's CPU snapshot holds (its share of the model)."""
        return sum(a.nbytes for a in (self._snapshot or {}).values())

    def set_filter(self, filter: str) -> None:
        """The filter of every later version (a run resolves ``auto`` once its engines are known)."""
        check_codec_choices(self.encoding, self.checksum, filter)
        with self._publish_lock:
            self.filter = filter

    def published_checksums(self, algorithm: str | None = None) -> dict[str, str]:
        """Checksums of every tensor of this rank's share of the last published (or baseline) state,
        keyed by HF name: what an engine serving ``latest`` must hold, byte for byte."""
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
        """Snapshot this rank's share of ``base_dir`` (and of this run's published versions, if any);
        publish nothing. Collective when sharded (rank 0 checks the store and names the run)."""
        latest, self.run_id = self._on_rank_0(lambda: (self._open_store(), self.run_id))
        snapshot, layouts = {}, {}
        entries = checkpoint_tensors(self.base_dir)
        self._served = ServedForm.of_checkpoint(self.base_dir, {n: e.dtype for n, (_, e) in entries.items()})
        if self.share is not None:
            self.share = self._served.share_with_scales(self.share)
        for name, (file_name, entry) in entries.items():
            layouts[name] = LocalTensor(entry.dtype, entry.shape, entry.nbytes, entry.itemsize)
            if self.share is None or name in self.share:
                snapshot[name] = np.frombuffer(read_bytes(self.base_dir / file_name, entry), dtype=np.uint8)
        if self.share is not None and not self.share <= layouts.keys():
            raise LayoutMismatch(f"the share names tensors the checkpoint {self.base_dir} does not have: "
                                 f"{sorted(self.share - layouts.keys())[:5]}")
        if latest is not None and latest.version > 0:
            plan = self.store.plan_chain(latest.version, VersionRef(latest.run_id, 0))
            for index in plan.versions:
                for _ in apply_version(self._pool, self.store.version_files(index.version), index, layouts,
                                       snapshot.__getitem__, snapshot.keys()):
                    pass
        self._snapshot, self._layouts, self._latest = snapshot, layouts, latest

    def _open_store(self) -> VersionRef | None:
        """Rank 0: the store's newest version of this run (a store of another run is refused or reset);
        leftovers of publishers that died are removed."""
        latest = self.store.latest()
        if latest is not None and self.run_id is not None and not same_run(latest.run_id, self.run_id):
            if not self.reset_store:
                raise ConfigError(
                    f"{STORE_FLAG} {self.store.display} holds run {latest.run_id!r} (at v{latest.version}); "
                    f"this run is {self.run_id!r}: use another directory or reset it",
                    flags=(STORE_FLAG,),
                )
            self.store.reset()
            latest = None
        if self.run_id is None:
            self.run_id = latest.run_id if latest is not None else uuid.uuid4().hex[:12]
        self.store.sweep()
        if self.base_in_store or self.model_in_store is not None:
            self._put_bases()  # the engines' version 0 comes from the store: put it there once
            latest = self.store.latest()
        return latest

    def _put_bases(self) -> None:
        """``base_dir`` as the store's version 0 of its kind (a model checkpoint, or an adapter
        directory: the adapter chain's), and ``model_in_store`` as the model's base."""
        from miles_disagg.weights.adapters import is_adapter_dir
        from miles_disagg.weights.object_base import ADAPTER, MODEL, publish_base

        if not isinstance(self.store, ObjectVersionStore):
            raise ConfigError(f"{STORE_FLAG} {self.store.display}: only an object store holds the base",
                              flags=(STORE_FLAG,))
        if self.model_in_store is not None:
            publish_base(self.store, self.model_in_store, self.run_id, MODEL)
        if self.base_in_store:
            publish_base(self.store, self.base_dir, self.run_id, ADAPTER if is_adapter_dir(self.base_dir) else MODEL)

    def publish(self, named_tensors: Iterable[tuple[str, Any]], *, full: bool = False) -> PublishResult | None:
        """Publish the next version from ``(hf_name, tensor)`` pairs (streamed, one at a time).

        Raises ``LayoutMismatch`` for an unknown name or a dtype/shape that differs from the
        baseline, ``PublishConflict`` when another publisher moved the pointer, and whatever
        the post-write hook raises; in every case the pointer and the snapshot are unchanged.
        Sharded: collective; rank 0 returns the version's result, the other ranks ``None``, and
        every rank raises (``ShareFailed`` where another rank failed) when nothing committed.

        ``full=True`` publishes a ``full`` anchor (every tensor whole) whatever the interval:
        a resumed trainer whose state differs from the store's newest version uses it so every
        host converges onto what the trainer holds.
        """
        with self._publish_lock:
            return self._publish(named_tensors, full)

    def _publish(self, named_tensors: Iterable[tuple[str, Any]], force_full: bool = False) -> PublishResult | None:
        if self._snapshot is None:
            raise InvalidInput("capture_baseline() must run before publish()")
        start = time.perf_counter()
        try:  # rank 0 decides the version and its codec, so every share is written as the index says
            staging, ref, spec, anchor = self._on_rank_0(lambda: self._next_version(force_full))
        except Exception:
            for _ in named_tensors:  # producing them is collective: every rank drains its iterator
                pass
            raise
        version = ref.version
        new_bytes: dict[str, np.ndarray] = {}
        manifest, failure = self._write_share(staging, spec, named_tensors, new_bytes, anchor)
        manifests = self.collective.gather(manifest)
        result: PublishResult | BaseException | None = None
        if self.collective.rank == 0:
            result = self._commit(staging, ref, spec, manifests or [], start)
        verdict = self.collective.broadcast(f"{type(result).__name__}: {result}"
                                            if isinstance(result, BaseException) else None)
        if failure is not None:
            raise failure
        if isinstance(result, BaseException):
            raise result
        if verdict is not None:
            raise ShareFailed(f"version {version} was not committed: {verdict}")
        for name, data in new_bytes.items():
            self._snapshot[name] = data
        self._latest = ref
        if self.collective.rank == 0 and spec.encoding == "full" and self.prune_on_anchor:
            self.store.prune()
        return result

    def _next_version(self, force_full: bool) -> tuple[Path, VersionRef, CodecSpec, bool]:
        """Rank 0: the staging dir, ref and codec of the next version, and whether it is an anchor."""
        version = (self._latest.version if self._latest else 0) + 1
        anchor = force_full or (self.full_anchor_interval > 0 and version % self.full_anchor_interval == 0)
        spec = publish_spec(self.encoding, self.filter, self.chunk_bytes, anchor)
        return self.store.new_staging_dir(version), VersionRef(self.run_id or "", version), spec, anchor

    def _on_rank_0(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on rank 0, its value on every rank; when it raises, rank 0 raises the error and
        the other ranks ``ShareFailed`` naming it (no rank is left waiting)."""
        value, error = None, None
        if self.collective.rank == 0:
            try:
                value = fn()
            except Exception as exc:
                error = exc
        ok, shared = self.collective.broadcast((True, value) if error is None
                                               else (False, f"{type(error).__name__}: {error}"))
        if error is not None:
            raise error
        if not ok:
            raise ShareFailed(f"rank 0 failed: {shared}")
        return shared

    def _write_share(self, staging: Path, spec: CodecSpec, named_tensors: Iterable[tuple[str, Any]],
                     new_bytes: dict[str, np.ndarray], anchor: bool) -> tuple[ShareManifest, BaseException | None]:
        """Encode and write this rank's share: its manifest, and the error when it failed (the
        tensors are still drained: producing them is collective on the trainer's ranks)."""
        start = time.perf_counter()
        tensors = iter(named_tensors)
        try:
            encoded, total = [], 0
            for result in encode_tensors(self._pool, spec, self.checksum, self._items(tensors, new_bytes, anchor)):
                total += result.nbytes
                if result.payload is None:
                    new_bytes.pop(result.name, None)
                else:
                    encoded.append(result)
            encode_s = time.perf_counter() - start
            share_dir = self.store.share_dir(staging)
            written, files, wire = write_share(share_dir, self.collective.rank, encoded, self._layouts, self.shard_bytes)
            stored = self.store.stage_files(share_dir, files)
        except Exception as exc:
            for _ in tensors:
                pass
            return ShareManifest(self.collective.rank, error=f"{type(exc).__name__}: {exc}"), exc
        return ShareManifest(self.collective.rank, written, files, wire, total, self.snapshot_bytes, encode_s,
                             time.perf_counter() - start - encode_s, objects=stored), None

    def _commit(self, staging: Path, ref: VersionRef, spec: CodecSpec, manifests: list[ShareManifest],
                start: float) -> PublishResult | BaseException:
        """Rank 0: the commit of every share (see :func:`commit_shares`), or the error that stopped it."""
        try:
            info = commit_shares(self.store, staging, ref, self._latest, manifests, spec, self.checksum,
                                 self._post_write)
        except Exception as exc:
            return exc
        changed = sum(m.changed_bytes for m in manifests)
        total = sum(m.total_bytes for m in manifests)
        encode_s = max(m.encode_time_s for m in manifests)
        return PublishResult(ref, changed / max(total, 1), info.wire_bytes, changed, total,
                             sum(len(m.tensors) for m in manifests), encode_s,
                             time.perf_counter() - start - encode_s, spec.encoding,
                             snapshot_bytes=max(m.snapshot_bytes for m in manifests),
                             num_ranks=sum(1 for m in manifests if m.total_bytes), commit_time_s=info.commit_time_s,
                             max_rank_wire_bytes=max(m.wire_bytes for m in manifests))

    def _items(self, named_tensors: Iterable[tuple[str, Any]], new_bytes: dict[str, np.ndarray],
               anchor: bool) -> Iterator[tuple[str, np.ndarray, np.ndarray, int]]:
        from miles_disagg.weights.torch_bytes import dtype_code, tensor_bytes

        assert self._snapshot is not None
        seen: set[str] = set()
        for name, tensor in self._served.served_tensors(named_tensors, self._snapshot.keys()):
            layout = self._layouts.get(name)
            if layout is None:
                raise LayoutMismatch(f"tensor {name!r} is not in the baseline checkpoint {self.base_dir}")
            if name in seen:
                raise InvalidInput(f"tensor {name!r} was given twice in one publish")
            seen.add(name)
            if name not in self._snapshot:
                continue  # another rank's share
            got = (dtype_code(tensor.dtype), tuple(tensor.shape))
            if got != (layout.dtype, layout.shape):
                raise LayoutMismatch(f"tensor {name!r} is {got[0]}{list(got[1])}, the baseline has {layout.dtype}{list(layout.shape)}")
            new_bytes[name] = tensor_bytes(tensor).copy()  # the caller may reuse its buffer
            yield name, self._snapshot[name], new_bytes[name], layout.itemsize
        if anchor:  # an anchor holds every tensor of the share, also those the caller did not send
            for name in sorted(self._snapshot.keys() - seen):
                yield name, self._snapshot[name], self._snapshot[name], self._layouts[name].itemsize

    def close(self) -> None:
        self._pool.shutdown(wait=True)
