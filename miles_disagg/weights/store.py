"""The version store: ``weight_vNNNNNN/`` directories plus the ``LATEST`` pointer.

Visibility: when ``LATEST`` exists it is the only source of truth; versions above it are
uncommitted (a crashed or racing publisher) and invisible. A store without ``LATEST``
(written by another disk-delta producer) exposes exactly the directories whose index is
present and carries no ``run_id`` (this project's own directories never count without
the pointer).

Commit (``commit``): the staged directory is complete and fsynced; under the store's
publish lock the pointer is compared with what the publisher expected, the directory is
renamed into place, the parent fsynced, the post-write hook run, and only then is
``LATEST`` replaced. A failure before the pointer moves removes the directory again; a
crash leaves at most an orphan directory that the next commit clears.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from miles_disagg.types import (
    FormatError,
    LineageError,
    PublishConflict,
    VersionConstraint,
    VersionNotReady,
    VersionRef,
    applies_onto,
    check_pointer_advance,
    parse_version_dirname,
    same_run,
    version_dirname,
)
from miles_disagg.weights.format import INDEX_NAME, VersionIndex, read_index
from miles_disagg.weights.jsonio import load_json
from miles_disagg.weights.safetensors_io import fsync_dir

POINTER_NAME = "LATEST"
LOCK_NAME = ".publish.lock"
STAGING_PREFIX = ".staging-"
TRASH_PREFIX = ".trash-"
STALE_STAGING_S = 3600.0  # a staging dir without an owner lock this old belongs to a publisher that died
OWNER_NAME = ".owner"  # inside a staging dir: flock-ed by the publisher writing it while it lives

PostWriteHook = Callable[[str, VersionRef], None]  # (version_dir, ref)


@dataclass(frozen=True)
class ChainPlan:
    """How to reach a target: start from ``start`` ("held", "anchor" or "base"), then apply ``versions`` in order."""

    start: str
    versions: tuple[VersionIndex, ...]


class VersionStore:
    """One publication directory. Reads are lock-free; commits are serialized by a file lock."""

    renames_share_files = True  # sharded publication renames the ranks' files to model-*-of-* at commit

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._owned: dict[Path, int] = {}  # staging dir -> fd holding its owner lock

    @property
    def display(self) -> str:
        """The store as messages name it."""
        return str(self.root)

    # ---------------------------------------------------------------- reading

    def version_dir(self, version: int) -> Path:
        return self.root / version_dirname(version)

    def payload_bytes(self, index: VersionIndex) -> int:
        """Bytes of a committed version's payload files as stored (missing files count 0)."""
        path = self.version_dir(index.version)
        return sum((path / f).stat().st_size for f in index.files() if (path / f).exists())

    def transfer_counts(self) -> dict[str, int]:
        """What reading versions moved over the network (a directory: nothing)."""
        return {}

    def version_files(self, version: int) -> Path:
        """A local directory holding the committed version's index and payloads (here: its own)."""
        return self.version_dir(version)

    def pointer(self) -> VersionRef | None:
        """The ``LATEST`` pointer, or ``None`` when absent."""
        path = self.root / POINTER_NAME
        try:
            obj = load_json(path.read_bytes(), path)
        except FileNotFoundError:
            return None
        run_id, version = (obj.get("run_id"), obj.get("version")) if isinstance(obj, dict) else (None, None)
        if not isinstance(run_id, str) or not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise FormatError(f"{path} is malformed: expected {{\"run_id\": str, \"version\": int >= 0}}, "
                              f"got {str(obj)[:200]}")
        return VersionRef(run_id, version)

    def _directories(self) -> Iterator[tuple[int, Path]]:
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            number = parse_version_dirname(path.name)
            if number is not None and (path / INDEX_NAME).is_file():
                yield number, path

    def _foreign_versions(self) -> list[int]:
        found = []
        for number, path in self._directories():
            try:
                if read_index(path).foreign:
                    found.append(number)
            except FormatError:
                found.append(number)  # visible, and reading it will report the problem
        return sorted(found)

    def _is_visible(self, version: int, pointer: VersionRef | None) -> bool:
        path = self.version_dir(version)
        if not (path / INDEX_NAME).is_file():
            return False
        if pointer is not None:
            return version <= pointer.version
        try:
            return read_index(path).foreign
        except FormatError:
            return True  # visible, and reading it will report the problem

    def visible_versions(self) -> list[int]:
        """Committed version numbers, oldest first."""
        pointer = self.pointer()
        if pointer is None:
            return self._foreign_versions()
        return sorted(n for n, _ in self._directories() if n <= pointer.version)

    def latest(self) -> VersionRef | None:
        """The newest committed version (``LATEST``, or the newest foreign directory)."""
        pointer = self.pointer()
        if pointer is not None:
            return pointer
        foreign = self._foreign_versions()
        return VersionRef("", foreign[-1]) if foreign else None

    def read_index(self, version: int) -> VersionIndex:
        """Index of a committed version; ``VersionNotReady`` when it is not visible.

        (Hosts run the pre-read hook once before they read a store: ``Materializer``.)
        """
        pointer = self.pointer()
        path = self.version_dir(version)
        if not self._is_visible(version, pointer):
            raise not_published(self.display, version, self.visible_versions())
        index = read_index(path)
        if pointer is not None and index.run_id != pointer.run_id:
            raise LineageError(
                f"{path.name} belongs to run {index.run_id!r} but LATEST names run {pointer.run_id!r}",
                expected=VersionRef(pointer.run_id, version), actual=index.ref,
            )
        return index

    def plan_chain(self, target: int, held: VersionRef | None) -> ChainPlan:
        """Versions to apply to reach ``target``: from the held version when it is on the
        target's lineage, else from the newest full anchor, else from the base.

        ``LineageError`` when the chain is broken (a delta whose base is not the previous
        version, mixed runs, or a pruned gap with no anchor to restart from).
        """
        chain = [self.read_index(target)]
        while True:
            index = chain[-1]
            if held is not None and applies_onto(index.base_ref, held):
                return ChainPlan("held", tuple(reversed(chain)))
            if index.delta_encoding == "full":
                return ChainPlan("anchor", tuple(reversed(chain)))
            if index.base_version != index.version - 1:
                raise LineageError(
                    f"{index.ref} declares base version {index.base_version}, expected {index.version - 1}",
                    expected=VersionRef(index.run_id, index.version - 1), actual=index.base_ref,
                )
            if index.base_version == 0:
                return ChainPlan("base", tuple(reversed(chain)))
            try:
                previous = self.read_index(index.base_version)
            except VersionNotReady:
                raise LineageError(
                    f"cannot reach {index.ref}: its base version {index.base_version} is not in the store "
                    "(pruned?) and no full anchor precedes it",
                    expected=index.base_ref, actual=held,
                ) from None
            if not same_run(previous.run_id, index.run_id):
                raise LineageError(
                    f"{index.ref} is based on version {previous.version} of a different run ({previous.run_id!r})",
                    expected=index.base_ref, actual=previous.ref,
                )
            chain.append(previous)

    # ---------------------------------------------------------------- committing

    def new_staging_dir(self, version: int) -> Path:
        """A fresh staging dir, owned by this process until :meth:`commit` or :meth:`release_staging`:
        it holds a file locked (``flock``) by us, so a later sweep knows at once when we died."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{STAGING_PREFIX}{version:06d}-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        fd = os.open(path / OWNER_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._owned[path] = fd
        return path

    def release_staging(self, path: Path) -> None:
        """Give up a staging dir (after it was committed or removed)."""
        fd = self._owned.pop(path, None)
        if fd is not None:
            os.close(fd)

    @contextlib.contextmanager
    def publish_lock(self) -> Iterator[None]:
        """Serialize commits across processes (``flock``; a no-op where unsupported)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing releases the lock

    def share_dir(self, staging: Path) -> Path:
        """Where a rank writes its share of ``staging`` (rank 0 made it: shared with every rank)."""
        return staging

    def stage_files(self, staging: Path, files: Sequence[str]) -> tuple[Any, ...]:
        """A rank's share files are in place once written (an object store uploads them here)."""
        return ()

    def commit(self, staging: Path, ref: VersionRef, expected: VersionRef | None,
               post_write_hook: PostWriteHook | None = None, objects: Sequence[Any] = ()) -> None:
        """Make ``staging`` visible as ``ref``; ``PublishConflict`` if the pointer is not ``expected``.
        (``objects``: what :meth:`stage_files` returned on every rank; nothing for a directory.)

        Ordering: rename into place -> fsync parent -> post-write hook -> replace LATEST.
        On any failure the pointer is unchanged and neither staging nor the directory remains.
        """
        final = self.version_dir(ref.version)
        try:
            with self.publish_lock():
                actual = self.latest()
                if actual != expected:
                    raise PublishConflict(expected, actual, ref)
                check_pointer_advance(expected, ref)
                if final.exists():
                    self._discard(final)  # an orphan: committed dirs never sit above the pointer
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(staging / OWNER_NAME)  # not part of the version (we still hold the lock)
                os.rename(staging, final)
                fsync_dir(self.root)
                try:
                    if post_write_hook is not None:
                        post_write_hook(str(final), ref)
                    self._write_pointer(ref)
                except BaseException:
                    self._discard(final)
                    raise
                self.sweep()
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
            self.release_staging(staging)

    def sweep(self, max_age_s: float = STALE_STAGING_S) -> list[str]:
        """Delete leftovers of crashed publishers (run at every commit): trash, staging dirs whose
        owner lock is free (their publisher died: at once), and staging dirs without an owner file
        older than ``max_age_s`` (written by an older version of this code)."""
        removed: list[str] = []
        if not self.root.is_dir():
            return removed
        now = time.time()
        for path in self.root.iterdir():
            staging = path.name.startswith(STAGING_PREFIX) and path not in self._owned
            stale = path.name.startswith(TRASH_PREFIX) or (staging and self._abandoned(path, now, max_age_s))
            if stale and path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
        return removed

    @staticmethod
    def _abandoned(path: Path, now: float, max_age_s: float) -> bool:
        try:
            fd = os.open(path / OWNER_NAME, os.O_RDWR)
        except FileNotFoundError:  # no owner file (yet, or older code): only age tells
            with contextlib.suppress(FileNotFoundError):
                return now - path.stat().st_mtime > max_age_s
            return False
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True  # nobody holds it: the publisher that wrote this is gone
        except OSError:
            return False
        finally:
            os.close(fd)

    def _write_pointer(self, ref: VersionRef) -> None:
        tmp = self.root / f".{POINTER_NAME}.{uuid.uuid4().hex[:12]}"
        with open(tmp, "w") as f:
            json.dump({"run_id": ref.run_id, "version": ref.version}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.root / POINTER_NAME)
        fsync_dir(self.root)

    def _discard(self, path: Path) -> None:
        """Remove a directory atomically from readers' view, then delete it."""
        trash = self.root / f"{TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:12]}"
        os.rename(path, trash)
        shutil.rmtree(trash, ignore_errors=True)

    def reset(self) -> None:
        """Remove every version, the pointer and leftovers (a new run taking over the store)."""
        with self.publish_lock():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / POINTER_NAME)
            for path in list(self.root.iterdir()):
                if parse_version_dirname(path.name) is not None or path.name.startswith((STAGING_PREFIX, TRASH_PREFIX)):
                    self._discard(path) if path.is_dir() else path.unlink()
            fsync_dir(self.root)

    # ---------------------------------------------------------------- retention

    def prune(self) -> list[int]:
        """Delete versions older than the newest full anchor; return the removed numbers.

        The newest anchor and every version after it stay, so a new or restarted host can
        always seed from the base layout plus the anchor and catch up. Without an anchor
        nothing is removed (hosts catch up from the base through every version).
        """
        with self.publish_lock():
            versions = self.visible_versions()
            anchors = [v for v in versions if read_index(self.version_dir(v)).delta_encoding == "full"]
            if not anchors:
                return []
            removed = [v for v in versions if v < anchors[-1]]
            for version in removed:
                self._discard(self.version_dir(version))
            self.sweep()
            return removed


def not_published(root: str | Path, version: int, visible: list[int]) -> VersionNotReady:
    """``VersionNotReady`` worded for the store (retryable: the version may still appear)."""
    error = VersionNotReady(VersionConstraint(exact_version=version), visible)
    shown = visible if len(visible) <= 8 else visible[:3] + ["..."] + visible[-3:]  # type: ignore[operator]
    error.args = (f"version {version} is not published in {root} (published: {shown or 'none'})",)
    return error
