"""The base checkpoint (version 0) held by an object store, so an engine node needs no copy of it.

``publish_base`` uploads every file of a local HF checkpoint under ``base/<attempt>/`` with a
manifest of sizes and checksums, then names it in ``LATEST`` (one conditional write: a store
whose pointer moved meanwhile is re-read and the base added to it, a store that already holds a
base keeps it). ``pull_base`` fetches it into a local directory, every file checked against the
manifest, the directory swapped in whole (a reader never sees half a base); a directory that
already holds this base (its marker names the manifest's checksum) is kept as it is.

A LoRA run's adapter chain has a version 0 of its own (the adapter as initialised, which every
adapter version's delta chain starts from): :data:`ADAPTER` puts it under ``lora-base/<attempt>/``
and names it ``lora_base`` in ``LATEST`` the same way, so an engine with only the store's URL fetches
it onto its own node; a pulled adapter is also checked whole
(:func:`~miles_disagg.weights.adapters.check_adapter_dir`) before it is swapped in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.types import FormatError, InvalidInput, VersionRef
from miles_disagg.weights.checksums import new_hasher
from miles_disagg.weights.jsonio import load_json
from miles_disagg.weights.adapters import ADAPTER_CONFIG, check_adapter_dir
from miles_disagg.weights.object_layout import (
    ADAPTER_BASE_PREFIX,
    BASE_PREFIX,
    MAX_MANIFEST_BYTES,
    OBJECT_CHECKSUM,
    Pointer,
    StoredObject,
    base_files,
    base_manifest_key,
)
from miles_disagg.weights.object_pulls import file_checksum, pull_all
from miles_disagg.weights.object_store import ObjectVersionStore
from miles_disagg.weights.s3_client import ConditionFailed
from miles_disagg.weights.stores import open_store

MARKER_NAME = ".miles-disagg-base.json"  # in a pulled base: which manifest it holds
POINTER_TRIES = 5


@dataclass(frozen=True)
class BaseKind:
    """Which version 0 a store holds: the model's base checkpoint, or an adapter chain's."""

    prefix: str  # the objects' folder in the store
    required: str  # the file every such directory has
    field: str  # the Pointer field naming its manifest
    what: str  # for messages

    def of(self, pointer: Pointer | None) -> StoredObject | None:
        return None if pointer is None else getattr(pointer, self.field)


MODEL = BaseKind(BASE_PREFIX, "config.json", "base", "base checkpoint")
ADAPTER = BaseKind(ADAPTER_BASE_PREFIX, ADAPTER_CONFIG, "adapter_base", "LoRA adapter chain's version 0")


def publish_base(store: ObjectVersionStore, base_dir: Path, run_id: str, kind: BaseKind = MODEL) -> StoredObject:
    """Make ``base_dir`` the store's base of ``kind`` unless it holds one; returns the base's manifest entry."""
    current = store.read_pointer()
    if kind.of(current) is not None:
        return kind.of(current)
    files = sorted(p for p in Path(base_dir).iterdir() if p.is_file() and p.name != MARKER_NAME)
    if not any(p.name == kind.required for p in files):
        raise InvalidInput(f"{base_dir} is not a {kind.what} directory (no {kind.required})")
    if kind is ADAPTER:
        check_adapter_dir(base_dir)
    attempt = uuid.uuid4().hex[:12]
    objects = {}
    for path in files:
        size, digest = file_checksum(path)
        store.client.upload_file(store.location.key(f"{kind.prefix}/{attempt}/{path.name}"), path)
        objects[path.name] = StoredObject(path.name, size, digest).to_json()
    body = json.dumps({"objects": objects, "run_id": run_id}, indent=1).encode()
    key = base_manifest_key(attempt, kind.prefix)
    store.client.put(store.location.key(key), body, if_none_match=True)
    hasher = new_hasher(OBJECT_CHECKSUM)
    hasher.update(body)
    manifest = StoredObject(key, len(body), hasher.hexdigest())
    for _ in range(POINTER_TRIES):  # another publisher may move LATEST meanwhile: add the base to what it wrote
        current = store.read_pointer()
        if kind.of(current) is not None:
            return kind.of(current)
        empty = Pointer(VersionRef(run_id, 0), {})
        proposed = dataclasses.replace(current or empty, etag="", **{kind.field: manifest})
        try:
            store.replace_pointer(current, proposed)
            return manifest
        except ConditionFailed:
            continue
    raise FormatError(f"{store.display}: LATEST kept changing while the {kind.what} was added ({POINTER_TRIES} tries)")


def pull_base(store: ObjectVersionStore, dest: Path, kind: BaseKind = MODEL) -> Path:
    """The store's base of ``kind`` in ``dest`` (fetched and checked unless ``dest`` holds it already)."""
    base = kind.of(store.read_pointer())
    if base is None:
        how = ("a LoRA run's trainer puts it there on an object store" if kind is ADAPTER else
               "publish one with --rollout-base-from-store or `miles-disagg weights publish --base-in-store`")
        raise InvalidInput(f"{store.display} holds no {kind.what} ({how})")
    dest = Path(os.path.abspath(dest))
    if _holds(dest, base):
        return dest
    where = f"{store.display}/{base.name}"
    folder = base.name.rsplit("/", 1)[0]
    scratch = dest.parent / f".{dest.name}.pull-{uuid.uuid4().hex[:8]}"
    try:
        store.pull_object(base.name, base, scratch / "manifest.json", MAX_MANIFEST_BYTES)
        files = base_files(load_json((scratch / "manifest.json").read_bytes(), where), where, kind.required)
        pull_all([lambda name=name, expected=expected: store.pull_object(f"{folder}/{name}", expected, scratch / name,
                                                                           expected.nbytes)
                  for name, expected in files.items()])
        (scratch / "manifest.json").unlink()
        if kind is ADAPTER:
            check_adapter_dir(scratch)  # FormatError naming the problem: nothing swapped in
        (scratch / MARKER_NAME).write_text(json.dumps({"manifest": base.name, "checksum": base.checksum}))
        _swap_in(scratch, dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return dest


def _holds(dest: Path, base: StoredObject) -> bool:
    try:
        marker = json.loads((dest / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("checksum") == base.checksum


def _swap_in(scratch: Path, dest: Path) -> None:
    """``dest`` := ``scratch``: a directory without our marker is never replaced (it is not ours)."""
    if dest.exists():
        if not (dest / MARKER_NAME).is_file() and any(dest.iterdir()):
            raise InvalidInput(f"{dest} holds files that are not a base pulled from a store; remove it or pick "
                               "another directory")
        old = dest.parent / f".{dest.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(dest, old)
        os.rename(scratch, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(scratch, dest)


def fetch_adapter_base(store_url: str, dest: Path) -> Path:
    """The adapter chain's version 0 of the object store ``store_url`` (a relay suffix allowed) in
    ``dest`` on this node: fetched and checked the first time, kept while the store names the same
    one. ``InvalidInput`` for a directory store (its adapter base is a path beside it), else the
    pull's typed errors (``FormatError``, ``ChecksumMismatch``) with ``dest`` unchanged."""
    dest = Path(dest)
    store = open_store(store_url, cache_dir=dest.parent / f".{dest.name}.mirror")
    if not isinstance(store, ObjectVersionStore):
        raise InvalidInput(f"{store_url}: the LoRA adapter chain's version 0 comes from an object store "
                           "(--lora-base-from-store), not a directory; give --lora-base-dir instead")
    return pull_base(store, dest, ADAPTER)
