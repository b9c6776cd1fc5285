"""The base checkpoint (version 0) held by an object store, so an engine node needs no copy of it.

``publish_base`` uploads every file of a local HF checkpoint under ``base/<attempt>/`` with a
manifest of sizes and checksums, then names it in ``LATEST`` (one conditional write: a store
whose pointer moved meanwhile is re-read and the base added to it, a store that already holds a
base keeps it). ``pull_base`` fetches it into a local directory, every file checked against the
manifest, the directory swapped in whole (a reader never sees half a base); a directory that
already holds this base (its marker names the manifest's checksum) is kept as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from miles_disagg.types import FormatError, InvalidInput, VersionRef
from miles_disagg.weights.checksums import new_hasher
from miles_disagg.weights.jsonio import load_json
from miles_disagg.weights.object_layout import (
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

MARKER_NAME = ".miles-disagg-base.json"  # in a pulled base: which manifest it holds
POINTER_TRIES = 5


def publish_base(store: ObjectVersionStore, base_dir: Path, run_id: str) -> StoredObject:
    """Make ``base_dir`` the store's base unless it holds one; returns the base's manifest entry."""
    current = store.read_pointer()
    if current is not None and current.base is not None:
        return current.base
    files = sorted(p for p in Path(base_dir).iterdir() if p.is_file() and p.name != MARKER_NAME)
    if not any(p.name == "config.json" for p in files):
        raise InvalidInput(f"{base_dir} is not a checkpoint directory (no config.json)")
    attempt = uuid.uuid4().hex[:12]
    objects = {}
    for path in files:
        size, digest = file_checksum(path)
        store.client.upload_file(store.location.key(f"base/{attempt}/{path.name}"), path)
        objects[path.name] = StoredObject(path.name, size, digest).to_json()
    body = json.dumps({"objects": objects, "run_id": run_id}, indent=1).encode()
    key = base_manifest_key(attempt)
    store.client.put(store.location.key(key), body, if_none_match=True)
    hasher = new_hasher(OBJECT_CHECKSUM)
    hasher.update(body)
    manifest = StoredObject(key, len(body), hasher.hexdigest())
    for _ in range(POINTER_TRIES):  # another publisher may move LATEST meanwhile: add the base to what it wrote
        current = store.read_pointer()
        if current is not None and current.base is not None:
            return current.base
        ref = current.ref if current is not None else VersionRef(run_id, 0)
        proposed = Pointer(ref, dict(current.manifests) if current else {}, base=manifest)
        try:
            store.replace_pointer(current, proposed)
            return manifest
        except ConditionFailed:
            continue
    raise FormatError(f"{store.display}: LATEST kept changing while the base was added ({POINTER_TRIES} tries)")


def pull_base(store: ObjectVersionStore, dest: Path) -> Path:
    """The store's base in ``dest`` (fetched and checked unless ``dest`` holds it already)."""
    current = store.read_pointer()
    if current is None or current.base is None:
        raise InvalidInput(f"{store.display} holds no base checkpoint (publish one with --rollout-base-from-store "
                           "or `miles-disagg weights publish --base-in-store`)")
    dest = Path(os.path.abspath(dest))
    if _holds(dest, current.base):
        return dest
    where = f"{store.display}/{current.base.name}"
    folder = current.base.name.rsplit("/", 1)[0]
    scratch = dest.parent / f".{dest.name}.pull-{uuid.uuid4().hex[:8]}"
    try:
        store.pull_object(current.base.name, current.base, scratch / "manifest.json", MAX_MANIFEST_BYTES)
        files = base_files(load_json((scratch / "manifest.json").read_bytes(), where), where)
        pull_all([lambda name=name, expected=expected: store.pull_object(f"{folder}/{name}", expected, scratch / name,
                                                                           expected.nbytes)
                  for name, expected in files.items()])
        (scratch / "manifest.json").unlink()
        (scratch / MARKER_NAME).write_text(json.dumps({"manifest": current.base.name,
                                                       "checksum": current.base.checksum}))
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
