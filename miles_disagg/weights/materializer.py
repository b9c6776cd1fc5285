"""Host side: materialize published versions into a host-local HF checkpoint.

Layout (``local_dir`` is always a loadable HF checkpoint)::

    <local_dir>            symlink -> <local_dir>.slots/a   (or /b)
    <local_dir>.slots/a/   the held version
    <local_dir>.slots/b/   scratch for the next prepare
    <local_dir>.slots/state.json   {"run_id", "version", "slot"}: what the host holds

``prepare`` rebuilds the inactive slot (hard links for files without changed tensors,
fresh copies for files it patches, so the held slot is never written), applies the
chain, verifies every changed tensor's final checksum, and only then writes the state
file and swaps the symlink (``os.replace``). Any failure raises a typed error, removes the
scratch slot it was writing and leaves the held version held and loadable. One prepare at a time per local dir (thread lock +
``flock``); readers of the held version are never disturbed by a prepare.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from miles_disagg.types import FormatError, InvalidInput, LayoutMismatch, LineageError, VersionRef, same_run
from miles_disagg.weights.adapters import check_adapter_dir, is_adapter_dir
from miles_disagg.weights.apply import LocalTensor, apply_version
from miles_disagg.weights.format import VersionIndex
from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook
from miles_disagg.weights.safetensors_io import TensorEntry, checkpoint_tensors, fsync_dir, read_bytes
from miles_disagg.weights.jsonio import load_json
from miles_disagg.weights.store import ChainPlan, VersionStore
from miles_disagg.weights.stores import open_store

if TYPE_CHECKING:
    import torch

SLOTS_SUFFIX = ".slots"
STATE_NAME = "state.json"
SLOT_NAMES = ("a", "b")
MIRROR_DIR_NAME = "store-mirror"  # in the slots dir: an object store's versions, pulled and checked


@dataclass(frozen=True)
class PreparedVersion:
    ref: VersionRef  # (run_id, version) the host now holds
    previous: VersionRef | None  # what it held before this prepare (None when freshly seeded)
    path: Path  # a loadable HF checkpoint directory holding exactly `ref`
    changed: tuple[str, ...]  # tensor names whose bytes differ from `previous` (all names if previous is None)
    transfer: dict[str, int] = field(default_factory=dict)  # an object store's pull: bytes by source
    fetch_s: float = 0.0  # of this prepare, the seconds spent reading the store (pointer, indexes, payloads)


class Materializer:
    """Keeps ``local_dir`` at a verified published version; see the module docstring."""

    def __init__(self, local_dir: str | Path, *, base_dir: str | Path,
                 pre_read_hook: str | Callable[..., Any] | None = None, num_workers: int = 2):
        self.local_dir = Path(os.path.abspath(local_dir))
        self.base_dir = Path(base_dir)
        self.slots_dir = self.local_dir.parent / (self.local_dir.name + SLOTS_SUFFIX)
        self.num_workers = max(1, int(num_workers))
        self._pre_read = load_hook(pre_read_hook, PRE_READ_FLAG)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the worker threads (a later prepare starts new ones)."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # ---------------------------------------------------------------- state

    def held(self) -> VersionRef | None:
        """The version ``local_dir`` holds, or ``None`` before the first prepare."""
        state = self._read_state()
        return None if state is None else VersionRef(str(state["run_id"]), int(state["version"]))

    def held_path(self) -> Path | None:
        state = self._read_state()
        return None if state is None else self.slots_dir / state["slot"]

    def _read_state(self) -> dict[str, Any] | None:
        path = self.slots_dir / STATE_NAME
        try:
            state = load_json(path.read_bytes(), path)
        except FileNotFoundError:
            return None
        except FormatError as exc:
            raise InvalidInput(f"{path} is corrupt ({exc}); remove {self.local_dir} and its slots") from None
        valid = isinstance(state, dict) and isinstance(state.get("run_id"), str) and isinstance(state.get("version"), int)
        if not valid or isinstance(state.get("version"), bool) or state["version"] < 0:
            raise InvalidInput(f"{path} is corrupt (expected run_id, version and slot); remove {self.local_dir} "
                               "and its slots")
        if state.get("slot") not in SLOT_NAMES:
            raise InvalidInput(f"{self.slots_dir / STATE_NAME} names an unknown slot {state.get('slot')!r}")
        return state

    def _pool_get(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="materialize")
        return self._pool

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        with self._lock:
            self.slots_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.slots_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                with contextlib.suppress(OSError):
                    fcntl.flock(fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)

    # ---------------------------------------------------------------- prepare to disk

    def prepare(self, store_dir: str | Path, target_version: int | None = None) -> PreparedVersion:
        """Make ``local_dir`` hold ``target_version`` (default: the store's latest), verified.

        Raises ``VersionNotReady`` (not published yet), ``LineageError``, ``LayoutMismatch``,
        ``FormatError`` or ``ChecksumMismatch``; on any error the held version is untouched.
        Preparing the held version returns at once with ``changed == ()``; an older version
        of the same run is refused (``LineageError``), except version 0: an explicit reset to
        the base checkpoint (no delta is applied; miles asks every host for version 0 when a
        trainer starts a new stream in a wiped store). A host holding another run's version
        (or one whose chain was pruned) reseeds from the base or the newest full anchor: a
        delta is only ever applied onto exactly its base version of its run.
        """
        with self._exclusive():
            self._check_local_dir()
            state = self._read_state()
            if state is not None:
                self._point_link(state["slot"])  # heal a crash between state write and link swap
            held = self.held()
            started = time.perf_counter()
            store, target_ref = self._open(store_dir, target_version)
            if held is not None and same_run(held.run_id, target_ref.run_id):
                if held.version == target_ref.version:
                    return PreparedVersion(held, held, self.slots_dir / state["slot"], ())
                if held.version > target_ref.version and target_ref.version != 0:
                    raise LineageError(
                        f"the host holds {held}, newer than the requested {target_ref}; "
                        "a delta is never applied twice and a host never moves backwards",
                        expected=target_ref, actual=held,
                    )
            plan = store.plan_chain(target_ref.version, held) if target_ref.version else ChainPlan("base", ())
            return self._build(store, plan, held, target_ref, state, time.perf_counter() - started)

    def _build(self, store: VersionStore, plan: ChainPlan, held: VersionRef | None,
               target: VersionRef, state: dict[str, Any] | None, fetch_s: float = 0.0) -> PreparedVersion:
        active = state["slot"] if state else None
        slot = "b" if active == "a" else "a"
        source = self.slots_dir / active if plan.start == "held" and active else self.base_dir
        tensors = checkpoint_tensors(source)
        touched: set[str] = set()
        for index in plan.versions:
            touched |= index.weight_map.keys()
        missing = sorted(touched - tensors.keys())
        if missing:
            raise LayoutMismatch(f"the store changes tensors the local checkpoint does not have: {missing[:5]}")
        dest = self.slots_dir / slot
        try:
            _populate(source, dest, {tensors[n][0] for n in touched})
            for index in plan.versions:
                started = time.perf_counter()
                files = store.version_files(index.version)
                fetch_s += time.perf_counter() - started
                self._apply_to_files(files, index, dest, tensors)
            fsync_dir(dest)
            if is_adapter_dir(dest):  # a LoRA adapter version: loadable as a whole, or refused
                check_adapter_dir(dest)
        except BaseException:
            shutil.rmtree(dest, ignore_errors=True)  # half a version is never left behind as a slot
            raise
        self._switch(slot, target)
        fresh = held is None or plan.start != "held"
        changed = tuple(sorted(tensors)) if fresh else tuple(sorted(touched))
        return PreparedVersion(target, held, dest, changed, store.transfer_counts(), fetch_s)

    def _apply_to_files(self, version_dir: Path, index: VersionIndex, dest: Path,
                        tensors: Mapping[str, tuple[str, TensorEntry]]) -> None:
        layouts = {n: _layout(e) for n, (_, e) in tensors.items()}
        buffers: dict[str, np.ndarray] = {}
        fds: dict[str, int] = {}

        def target_of(name: str) -> np.ndarray:
            file_name, entry = tensors[name]
            buffers[name] = np.frombuffer(read_bytes(dest / file_name, entry), dtype=np.uint8)
            return buffers[name]

        pool = self._pool_get()
        writes = []
        try:
            for name in apply_version(pool, version_dir, index, layouts, target_of):
                file_name, entry = tensors[name]
                if file_name not in fds:
                    fds[file_name] = os.open(dest / file_name, os.O_RDWR)
                writes.append(pool.submit(_pwrite_all, fds[file_name], buffers.pop(name), entry.offset))
            for write in writes:
                write.result()
            list(pool.map(os.fsync, fds.values()))
        finally:
            for write in writes:
                write.cancel() or write.exception()  # every write is over before its file is closed
            for fd in fds.values():
                os.close(fd)

    def _switch(self, slot: str, ref: VersionRef) -> None:
        """Commit point: the state file names the new slot, then the symlink follows."""
        tmp = self.slots_dir / f".{STATE_NAME}.{uuid.uuid4().hex[:8]}"
        with open(tmp, "w") as f:
            json.dump({"run_id": ref.run_id, "version": ref.version, "slot": slot}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.slots_dir / STATE_NAME)
        fsync_dir(self.slots_dir)
        self._point_link(slot)

    def _point_link(self, slot: str) -> None:
        target = os.path.join(self.slots_dir.name, slot)
        if self.local_dir.is_symlink() and os.readlink(self.local_dir) == target:
            return
        tmp = self.local_dir.parent / f".{self.local_dir.name}.link-{uuid.uuid4().hex[:8]}"
        os.symlink(target, tmp)
        os.replace(tmp, self.local_dir)
        fsync_dir(self.local_dir.parent)

    def _open(self, store_dir: str | Path, target_version: int | None) -> tuple[VersionStore, VersionRef]:
        """The store and the target; the pre-read hook runs once, before any version is read.

        As SGLang's /pull_weights calls it: ``hook(source_dir, target_version)`` for a target
        above 0 (the latest version number when no target is given).
        """
        store = open_store(store_dir, cache_dir=self.slots_dir / MIRROR_DIR_NAME)
        if target_version is None:
            latest = store.latest()
            target_version = latest.version if latest else 0
        if target_version > 0 and self._pre_read is not None:
            self._pre_read(str(store_dir), target_version)
        return store, _resolve_target(store, target_version)

    def _check_local_dir(self) -> None:
        """``local_dir`` must be absent, an empty directory, or this materializer's symlink."""
        path = self.local_dir
        if path.is_symlink():
            if os.readlink(path) not in {os.path.join(self.slots_dir.name, s) for s in SLOT_NAMES}:
                raise InvalidInput(f"{path} is a symlink not managed by miles-disagg; remove it or pick another local dir")
        elif path.is_dir():
            if any(path.iterdir()):
                raise InvalidInput(f"{path} already holds files not managed by miles-disagg; remove it or pick another local dir")
            path.rmdir()
        elif path.exists():
            raise InvalidInput(f"{path} exists and is not a directory")

    # ---------------------------------------------------------------- prepare in RAM

    def prepare_in_memory(self, store_dir: str | Path, target_version: int | None,
                          tensors: Mapping[str, "torch.Tensor"], held: VersionRef) -> dict[str, "torch.Tensor"]:
        """Changed tensors at ``target_version``, computed from ``tensors`` (at ``held``) and verified.

        ``tensors`` are not modified. Needs the chain from ``held`` (or a full anchor);
        otherwise ``LineageError``. Returns ``{}`` when ``held`` is already the target.
        """
        from miles_disagg.weights.torch_bytes import bytes_to_tensor, dtype_code, tensor_bytes

        store, target = self._open(store_dir, target_version)
        if same_run(held.run_id, target.run_id) and held.version >= target.version:
            if held.version == target.version:
                return {}
            raise LineageError(f"the engine holds {held}, newer than the requested {target}", expected=target, actual=held)
        plan = store.plan_chain(target.version, held)
        if plan.start == "base":
            raise LineageError(f"{target} is not reachable from {held} without reseeding from the base checkpoint",
                               expected=plan.versions[0].base_ref, actual=held)
        layouts = {}
        for name, t in tensors.items():
            code = dtype_code(t.dtype)
            layouts[name] = LocalTensor(code, tuple(t.shape), t.numel() * t.element_size(), t.element_size())
        buffers: dict[str, np.ndarray] = {}

        def target_of(name: str) -> np.ndarray:
            if name not in buffers:
                buffers[name] = tensor_bytes(tensors[name]).copy()
            return buffers[name]

        with self._lock:
            for index in plan.versions:
                for _ in apply_version(self._pool_get(), store.version_files(index.version), index, layouts, target_of):
                    pass
        return {n: bytes_to_tensor(b, tensors[n].dtype, tuple(tensors[n].shape)) for n, b in buffers.items()}


def _resolve_target(store: VersionStore, target_version: int | None) -> VersionRef:
    """The target as a ``VersionRef`` (run from its index); ``VersionNotReady`` if unpublished."""
    if target_version is None:
        latest = store.latest()
        target_version = latest.version if latest else 0
    if target_version < 0:
        raise InvalidInput(f"target version must be >= 0, got {target_version}")
    if target_version == 0:
        pointer = store.pointer()
        return VersionRef(pointer.run_id if pointer else "", 0)
    return store.read_index(target_version).ref


def _layout(entry: TensorEntry) -> LocalTensor:
    return LocalTensor(entry.dtype, entry.shape, entry.nbytes, entry.itemsize)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def _populate(source: Path, dest: Path, patched_files: set[str]) -> None:
    """Rebuild ``dest`` from ``source``: hard links for unchanged ``*.safetensors`` shards,
    fresh copies of everything else (config, tokenizer, and the shards to be patched), so
    patching can never reach the source through a shared inode.
    """
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for entry in sorted(source.iterdir()):
        target = dest / entry.name
        if entry.name in patched_files or (entry.is_file() and entry.suffix != ".safetensors"):
            shutil.copyfile(entry, target)  # small files are copied so editing them never reaches the source
        elif entry.is_dir():  # e.g. original/ weights of HF repos: never patched, so linked
            shutil.copytree(entry, target, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(entry), str(target))
