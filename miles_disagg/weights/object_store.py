"""The version store on an S3-compatible object store (layout and commit rule: :mod:`object_layout`).

It is a :class:`VersionStore` whose ``root`` is a host-local mirror: each version a reader needs is
pulled into ``<root>/mirror/weight_vNNNNNN/<attempt>/`` (the manifest checked against ``LATEST``'s
size and checksum, every object against the manifest's), so everything that applies a version
from a directory applies it from the mirror unchanged. Nothing unverified ever sits under a final
name in the mirror (objects are written to a temporary name, checked, then renamed).

Publishing: the publisher stages files locally as for a directory (``<root>/.staging-...``); each
rank uploads its share's files under the attempt's prefix (:meth:`stage_files`), rank 0 writes the
manifest (``If-None-Match: *``) and then moves ``LATEST`` (``If-Match``): the one commit. A commit
that fails after its first upload deletes that attempt's objects again; one that dies leaves
objects no pointer names, which :meth:`sweep` deletes when they can never commit (their version is
at or below ``LATEST``'s) or when they are older than ``STALE_ATTEMPT_S``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator, Sequence

from miles_disagg.types import (
    ChecksumMismatch,
    FormatError,
    LineageError,
    PublishConflict,
    VersionRef,
    check_pointer_advance,
    parse_version_dirname,
)
from miles_disagg.weights.checksums import new_hasher
from miles_disagg.weights.format import INDEX_NAME, VersionIndex, parse_index
from miles_disagg.weights.jsonio import load_json
from miles_disagg.weights.location import ObjectLocation
from miles_disagg.weights.object_layout import (
    ADAPTER_BASE_PREFIX,
    MAX_MANIFEST_BYTES,
    BASE_PREFIX,
    MAX_POINTER_BYTES,
    OBJECT_CHECKSUM,
    POINTER_KEY,
    Pointer,
    StoredObject,
    attempt_prefix,
    check_attempt,
    manifest_key,
    parse_objects,
    parse_pointer,
    split_manifest_key,
)
from miles_disagg.weights.object_pulls import TransferStats, check_object, file_checksum, pull_all
from miles_disagg.weights.relay_client import RelayClient, RelayFailed
from miles_disagg.weights.s3_client import ConditionFailed, ObjectClient
from miles_disagg.weights.store import STAGING_PREFIX, PostWriteHook, VersionStore, not_published

logger = logging.getLogger(__name__)

MIRROR_NAME = "mirror"
STALE_ATTEMPT_S = 3600.0


class ObjectVersionStore(VersionStore):
    """One prefix of a bucket, read through a host-local mirror; see the module docstring."""

    renames_share_files = False  # shares are uploaded under their own names: an object is never renamed

    def __init__(self, location: ObjectLocation, cache_dir: str | Path, client: ObjectClient | None = None):
        super().__init__(cache_dir)
        self.location = location
        self.client = client or ObjectClient(location)
        self.relay = RelayClient(location.relay_url) if location.relay_url else None
        self.transfer = TransferStats()  # what this store's pulls moved, and from where
        self._last: Pointer | None = None  # the newest pointer read: committed versions never change

    @property
    def display(self) -> str:
        return self.location.display

    # ---------------------------------------------------------------- reading

    def read_pointer(self) -> Pointer | None:
        """``LATEST`` now, with its ETag (``None``: an empty store)."""
        found = self.client.get(self.location.key(POINTER_KEY), MAX_POINTER_BYTES)
        if found is None:
            self._last = None
            return None
        where = f"{self.display}/{POINTER_KEY}"
        self._last = parse_pointer(load_json(found[0], where), found[1], where)
        return self._last

    def pointer(self) -> VersionRef | None:
        current = self.read_pointer()
        return None if current is None else current.ref

    def latest(self) -> VersionRef | None:
        return self.pointer()  # an object store holds no foreign versions: LATEST is the truth

    def visible_versions(self) -> list[int]:
        current = self.read_pointer()
        return [] if current is None else sorted(current.manifests)

    def _manifest_entry(self, version: int) -> tuple[Pointer, StoredObject]:
        current = self._last if self._last is not None and version in self._last.manifests else self.read_pointer()
        if current is None or version not in current.manifests:
            raise not_published(self.display, version, [] if current is None else sorted(current.manifests))
        return current, current.manifests[version]

    def _mirror_dir(self, manifest: StoredObject) -> Path:
        return self.root / MIRROR_NAME / Path(manifest.name).parent

    def read_index(self, version: int) -> VersionIndex:
        current, manifest = self._manifest_entry(version)
        index, _ = self._manifest(version, manifest)
        if index.run_id != current.ref.run_id:
            raise LineageError(f"version {version} belongs to run {index.run_id!r} but LATEST names run "
                               f"{current.ref.run_id!r}", expected=VersionRef(current.ref.run_id, version),
                               actual=index.ref)
        return index

    def _manifest(self, version: int, manifest: StoredObject) -> tuple[VersionIndex, dict[str, StoredObject]]:
        """The manifest's index and objects, from the mirror (pulled and checked first if absent)."""
        where = f"{self.display}/{manifest.name}"
        split_manifest_key(manifest.name, version, where)
        local = self._mirror_dir(manifest) / INDEX_NAME
        if not local.is_file():
            self.pull_object(manifest.name, manifest, local, MAX_MANIFEST_BYTES)
        obj = load_json(local.read_bytes(), where)
        index = parse_index(obj, where)
        if index.version != version:
            raise FormatError(f"{where}: the manifest says version {index.version}, LATEST lists it as {version}")
        return index, parse_objects(obj.get("objects"), set(index.files()), where)

    def transfer_counts(self) -> dict[str, int]:
        return self.transfer.snapshot()

    def payload_bytes(self, index: VersionIndex) -> int:
        _, manifest = self._manifest_entry(index.version)
        _, objects = self._manifest(index.version, manifest)
        return sum(objects[name].nbytes for name in index.files())

    def version_files(self, version: int) -> Path:
        """A local directory holding the version's index and payloads, every object checked."""
        _, manifest = self._manifest_entry(version)
        index, objects = self._manifest(version, manifest)
        folder = self._mirror_dir(manifest)
        prefix = Path(manifest.name).parent
        missing = [name for name in index.files() if not (folder / name).is_file()]
        pull_all([lambda name=name: self.pull_object(f"{prefix}/{name}", objects[name], folder / name, objects[name].nbytes)
                  for name in missing])
        return folder

    def pull_object(self, relative_key: str, expected: StoredObject, dest: Path, max_bytes: int) -> None:
        """One object into ``dest``, checked against ``expected``: a missing, short, long or corrupt
        object is refused (``FormatError`` / ``ChecksumMismatch``) and nothing lands under ``dest``.
        With a relay, its copy is tried first; anything wrong with it (down, slow, short, corrupt)
        falls back to the store, counted in :attr:`transfer`."""
        where = f"{self.display}/{relative_key}"
        if expected.nbytes > max_bytes:
            raise FormatError(f"{where}: listed at {expected.nbytes} bytes, more than {max_bytes}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:12]}.part"
        key = self.location.key(relative_key)
        try:
            if self.relay is None or not self._from_relay(key, tmp, expected, where):
                size = self.client.download(key, tmp, expected.nbytes)
                self.transfer.add(store_bytes=max(size, 0))
                check_object(tmp, size, expected, where, relative_key)
            os.replace(tmp, dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _from_relay(self, key: str, tmp: Path, expected: StoredObject, where: str) -> bool:
        """The object from the region's relay, checked; False (and counted) when the store must serve it."""
        assert self.relay is not None
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            answer = self.relay.download(key, fd, expected.nbytes)
            os.fsync(fd)
        except RelayFailed as exc:
            self._relay_fell_back(f"{exc}")
            return False
        finally:
            os.close(fd)
        try:
            check_object(tmp, answer.nbytes, expected, where, key)
        except (FormatError, ChecksumMismatch) as exc:
            self._relay_fell_back(f"its copy is wrong ({exc})")
            return False
        self.transfer.add(relay_bytes=answer.nbytes, relay_wan_bytes=answer.nbytes if answer.crossed_wan else 0)
        return True

    def _relay_fell_back(self, why: str) -> None:
        self.transfer.add(relay_fallbacks=1)
        logger.warning("relay %s failed (%s); pulling from %s directly", self.location.relay_url, why, self.display)

    # ---------------------------------------------------------------- publishing

    def share_dir(self, staging: Path) -> Path:
        """Each rank stages its share on its own disk (nodes share no directory) under rank 0's name."""
        staging.mkdir(parents=True, exist_ok=True)
        return staging

    def stage_files(self, staging: Path, files: Sequence[str]) -> tuple[StoredObject, ...]:
        """Upload a rank's share files of ``staging`` under the attempt's prefix (then drop the local copies)."""
        version, attempt = _staging_attempt(staging)
        stored = []
        for name in files:
            path = staging / name
            size, digest = file_checksum(path)
            self.client.upload_file(self.location.key(f"{attempt_prefix(version, attempt)}/{name}"), path)
            stored.append(StoredObject(name, size, digest))
            path.unlink()
        return tuple(stored)

    def commit(self, staging: Path, ref: VersionRef, expected: VersionRef | None,
               post_write_hook: PostWriteHook | None = None, objects: Sequence[StoredObject] = ()) -> None:
        """Make the staged attempt visible as ``ref``: upload what is left in ``staging``, create the
        manifest, run the hook, move ``LATEST`` with ``If-Match``. ``PublishConflict`` when ``LATEST`` is
        not ``expected`` (before or at the conditional write); on any failure the attempt's objects
        are deleted again and ``LATEST`` is unchanged."""
        version, attempt = _staging_attempt(staging)
        try:
            current = self.read_pointer()
            if (current.ref if current else None) != expected:
                raise PublishConflict(expected, current.ref if current else None, ref)
            check_pointer_advance(expected, ref)
            manifest = self._write_manifest(staging, version, attempt, objects)
            try:
                if post_write_hook is not None:
                    post_write_hook(f"{self.location.url.split('?')[0]}/{attempt_prefix(version, attempt)}", ref)
                self._move_pointer(current, ref, manifest, expected)
            except BaseException:
                self._delete_attempt(version, attempt)
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
            self.release_staging(staging)

    def _write_manifest(self, staging: Path, version: int, attempt: str,
                        uploaded: Sequence[StoredObject]) -> StoredObject:
        index_path = staging / INDEX_NAME
        obj = load_json(index_path.read_bytes(), index_path)
        rest = sorted(p.name for p in staging.iterdir() if p.name.endswith(".safetensors"))
        objects = {o.name: o for o in (*uploaded, *self.stage_files(staging, rest))}
        obj["objects"] = {name: o.to_json() for name, o in sorted(objects.items())}
        body = json.dumps(obj, indent=1).encode()
        key = manifest_key(version, attempt)
        try:
            self.client.put(self.location.key(key), body, if_none_match=True)
        except ConditionFailed:
            raise FormatError(f"{self.display}/{key} exists already: a publish attempt's name was reused") from None
        hasher = new_hasher(OBJECT_CHECKSUM)
        hasher.update(body)
        return StoredObject(key, len(body), hasher.hexdigest())

    def _move_pointer(self, current: Pointer | None, ref: VersionRef, manifest: StoredObject,
                      expected: VersionRef | None) -> None:
        proposed = Pointer(ref, {ref.version: manifest}) if current is None else current.with_version(ref, manifest)
        try:
            self.replace_pointer(current, proposed)
        except ConditionFailed:
            raise PublishConflict(expected, self.pointer(), ref) from None

    def replace_pointer(self, current: Pointer | None, proposed: Pointer) -> None:
        """``LATEST`` := ``proposed`` if it is still ``current`` (``ConditionFailed`` otherwise)."""
        body = json.dumps(proposed.to_json()).encode()
        if current is None:
            etag = self.client.put(self.location.key(POINTER_KEY), body, if_none_match=True)
        else:
            etag = self.client.put(self.location.key(POINTER_KEY), body, if_match=current.etag)
        self._last = proposed.at_etag(etag)

    # ---------------------------------------------------------------- cleanup and retention

    @contextlib.contextmanager
    def publish_lock(self) -> Iterator[None]:
        yield  # the conditional writes serialize commits: no lock service

    def _attempts(self) -> dict[tuple[int, str], list[tuple[str, float]]]:
        """Every attempt's objects in the store (listing: cleanup only, never for reading)."""
        found: dict[tuple[int, str], list[tuple[str, float]]] = {}
        for info in self.client.list("weight_v"):
            parts = self.location.relative(info.key).split("/")
            version = parse_version_dirname(parts[0]) if len(parts) == 3 else None
            if version is not None:
                found.setdefault((version, parts[1]), []).append((info.key, info.modified_unix))
        return found

    def _delete_attempt(self, version: int, attempt: str) -> None:
        with contextlib.suppress(Exception):  # best effort: sweep removes what is left
            keys = [i.key for i in self.client.list(attempt_prefix(version, attempt) + "/")]
            self.client.delete(keys)

    def sweep(self, max_age_s: float = STALE_ATTEMPT_S) -> list[str]:
        """Local leftovers (as for a directory), and attempts no pointer names that can never commit
        (version at or below ``LATEST``'s) or that are older than ``max_age_s``."""
        import time

        removed = super().sweep(max_age_s)
        current = self.read_pointer()
        named = {(v, split_manifest_key(m.name, v, self.display)) for v, m in (current.manifests if current else {}).items()}
        head = current.ref.version if current else 0
        now = time.time()
        doomed = []
        for (version, attempt), objects in self._attempts().items():
            stale = all(now - modified > max_age_s for _, modified in objects)
            if (version, attempt) not in named and (version <= head or stale):
                doomed += [key for key, _ in objects]
                removed.append(attempt_prefix(version, attempt))
        self.client.delete(doomed)
        return removed

    def prune(self) -> list[int]:
        """Drop the versions older than the newest full anchor from ``LATEST`` (one conditional write;
        a lost race prunes nothing), then delete their objects."""
        current = self.read_pointer()
        if current is None:
            return []
        anchors = [v for v in sorted(current.manifests) if self.read_index(v).delta_encoding == "full"]
        if not anchors:
            return []
        removed = [v for v in current.manifests if v < anchors[-1]]
        kept = current.keeping({v for v in current.manifests if v >= anchors[-1]})
        try:
            etag = self.client.put(self.location.key(POINTER_KEY), json.dumps(kept.to_json()).encode(),
                                   if_match=current.etag)
        except ConditionFailed:
            return []
        self._last = kept.at_etag(etag)
        for version in removed:
            self._delete_attempt(version, split_manifest_key(current.manifests[version].name, version, self.display))
        return sorted(removed)

    def reset(self) -> None:
        """Remove ``LATEST`` first (no version is visible from then on), then every version's objects."""
        self.client.delete([self.location.key(POINTER_KEY)])
        self._last = None
        self.client.delete([key for objects in self._attempts().values() for key, _ in objects])
        for prefix in (BASE_PREFIX, ADAPTER_BASE_PREFIX):
            self.client.delete([info.key for info in self.client.list(f"{prefix}/")])
        shutil.rmtree(self.root / MIRROR_NAME, ignore_errors=True)


def _staging_attempt(staging: Path) -> tuple[int, str]:
    """``(version, attempt)`` of a staging directory ``.staging-NNNNNN-<attempt>``."""
    name = staging.name
    if not name.startswith(STAGING_PREFIX):
        raise FormatError(f"{staging} is not a staging directory")
    number, _, attempt = name[len(STAGING_PREFIX):].partition("-")
    if not number.isdigit():
        raise FormatError(f"{staging} is not a staging directory")
    return int(number), check_attempt(attempt)
