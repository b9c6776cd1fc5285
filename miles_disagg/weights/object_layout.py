"""The version store's layout on an object store, and the validation of what it reads there. Pure.

Under the location's prefix::

    LATEST                                         the pointer (below); the one object ever overwritten
    base/<attempt>/manifest.json                   the base checkpoint (version 0), when the store holds it:
    base/<attempt>/<file>                          {"objects": {file: {"bytes", "checksum"}}}, every file of it
    lora-base/<attempt>/manifest.json              a LoRA run's adapter chain's version 0 (the adapter as
    lora-base/<attempt>/<file>                     initialised), in the same form, when the store holds it
    weight_v000007/<attempt>/model.safetensors.index.json    the manifest: the version's index, plus
                                                   "objects": {file: {"bytes": n, "checksum": xxh3-128}}
    weight_v000007/<attempt>/<file>.safetensors    the payloads the manifest names

``LATEST`` is ``{"format", "run_id", "version", "versions": {"7": {"manifest": key, "bytes": n,
"checksum": h}, ...}, "base": {...}}``: every retained committed version, by the key of its manifest
and that manifest's size and checksum, the base's manifest when the store holds the base, and
``"lora_base"`` the adapter chain's version 0 when it holds that (then ``version`` may be 0: a store
holding only its base). A reader takes the version list from ``LATEST`` and the object list
from the manifest, never from a listing, and checks each object's size and checksum before use.

Each publish attempt writes under a fresh ``<attempt>`` name that no reader follows; its commit is
one conditional write of ``LATEST`` (``If-Match`` on the ETag the publisher read, ``If-None-Match:
*`` for the first version), so of two publishers racing for one version exactly one wins, and a
publisher that dies at any moment leaves only objects no pointer names (removed later by
:meth:`~miles_disagg.weights.object_store.ObjectVersionStore.sweep`). The manifest itself is created
with ``If-None-Match: *``: an attempt's objects are never overwritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from miles_disagg.types import FormatError, VersionRef, parse_version_dirname, version_dirname
from miles_disagg.weights.format import INDEX_NAME, check_payload_name

POINTER_KEY = "LATEST"
BASE_PREFIX = "base"
ADAPTER_BASE_PREFIX = "lora-base"  # a LoRA run's adapter chain's version 0
BASE_MANIFEST = "manifest.json"
POINTER_FORMAT = "miles-disagg-object-store/1"
OBJECT_CHECKSUM = "xxh3-128"
MAX_POINTER_BYTES = 8 * 1024 * 1024
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_OBJECTS = 100_000
MAX_OBJECT_BYTES = 1 << 40
_ATTEMPT = re.compile(r"^[0-9a-f]{12,32}$")
_HEX = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class StoredObject:
    """One object of a version (or a manifest): its name, size and checksum."""

    name: str
    nbytes: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "checksum": self.checksum}


@dataclass(frozen=True)
class Pointer:
    """What ``LATEST`` says, with the ETag it was read at (the commit's condition)."""

    ref: VersionRef
    manifests: Mapping[int, StoredObject]  # version -> its manifest (name = the manifest's relative key)
    etag: str = ""
    base: StoredObject | None = None  # the base checkpoint's manifest, when the store holds the base
    adapter_base: StoredObject | None = None  # the adapter chain's version 0's manifest, when it holds that

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {"format": POINTER_FORMAT, "run_id": self.ref.run_id, "version": self.ref.version,
                               "versions": {str(v): {"manifest": m.name, **m.to_json()}
                                            for v, m in sorted(self.manifests.items())}}
        if self.base is not None:
            obj["base"] = {"manifest": self.base.name, **self.base.to_json()}
        if self.adapter_base is not None:
            obj["lora_base"] = {"manifest": self.adapter_base.name, **self.adapter_base.to_json()}
        return obj

    def with_version(self, ref: VersionRef, manifest: StoredObject) -> "Pointer":
        return Pointer(ref, {**self.manifests, ref.version: manifest}, base=self.base, adapter_base=self.adapter_base)

    def keeping(self, versions: set[int]) -> "Pointer":
        return Pointer(self.ref, {v: m for v, m in self.manifests.items() if v in versions}, self.etag, self.base,
                       self.adapter_base)

    def at_etag(self, etag: str) -> "Pointer":
        """This pointer as written, at the ETag the write returned."""
        return Pointer(self.ref, self.manifests, etag, self.base, self.adapter_base)


def attempt_prefix(version: int, attempt: str) -> str:
    return f"{version_dirname(version)}/{attempt}"


def manifest_key(version: int, attempt: str) -> str:
    return f"{attempt_prefix(version, attempt)}/{INDEX_NAME}"


def base_manifest_key(attempt: str, prefix: str = BASE_PREFIX) -> str:
    return f"{prefix}/{attempt}/{BASE_MANIFEST}"


def check_attempt(attempt: str) -> str:
    if not _ATTEMPT.match(attempt):
        raise FormatError(f"{attempt!r} is not a publish attempt name")
    return attempt


def split_manifest_key(key: object, version: int, where: str) -> str:
    """The attempt of a manifest key ``weight_vNNNNNN/<attempt>/model.safetensors.index.json``
    (of exactly ``version``); ``FormatError`` for anything else, e.g. a key outside the version."""
    parts = key.split("/") if isinstance(key, str) else []
    if len(parts) != 3 or parts[2] != INDEX_NAME or parse_version_dirname(parts[0]) != version \
            or not _ATTEMPT.match(parts[1]):
        raise FormatError(f"{where}: version {version}'s manifest {str(key)[:200]!r} is not "
                          f"{version_dirname(version)}/<attempt>/{INDEX_NAME}")
    return parts[1]


def parse_pointer(obj: Any, etag: str, where: str) -> Pointer:
    """Validate ``LATEST`` as read (hostile: a store's every byte is); ``FormatError`` naming the problem."""
    if not isinstance(obj, dict) or obj.get("format") != POINTER_FORMAT:
        raise FormatError(f"{where}: not a pointer of this project's object store (format {POINTER_FORMAT!r})")
    run_id, version, versions = obj.get("run_id"), obj.get("version"), obj.get("versions")
    if not isinstance(run_id, str) or not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise FormatError(f"{where}: expected run_id (text) and version (an integer >= 0)")
    if not isinstance(versions, dict) or len(versions) > MAX_OBJECTS:
        raise FormatError(f"{where}: 'versions' must be an object of at most {MAX_OBJECTS} entries")
    manifests = {}
    for text, entry in versions.items():
        number = int(text) if isinstance(text, str) and text.isdigit() and len(text) <= 9 else -1
        if number < 1 or number > version:
            raise FormatError(f"{where}: lists version {str(text)[:20]!r}, not in 1..{version}")
        if not isinstance(entry, dict):
            raise FormatError(f"{where}: version {number}'s entry is not an object")
        split_manifest_key(entry.get("manifest"), number, where)
        manifests[number] = StoredObject(entry["manifest"], *_size_and_checksum(entry, f"{where}: version {number}"))
    if version > 0 and version not in manifests:
        raise FormatError(f"{where}: names version {version} but lists no manifest for it")
    base = _base_entry(obj.get("base"), where)
    adapter_base = _base_entry(obj.get("lora_base"), where, ADAPTER_BASE_PREFIX)
    if version == 0 and base is None and adapter_base is None:
        raise FormatError(f"{where}: names version 0 but holds no base")
    return Pointer(VersionRef(run_id, version), manifests, etag, base, adapter_base)


def _base_entry(entry: Any, where: str, prefix: str = BASE_PREFIX) -> StoredObject | None:
    if entry is None:
        return None
    parts = entry.get("manifest").split("/") if isinstance(entry, dict) and isinstance(entry.get("manifest"), str) else []
    if len(parts) != 3 or parts[0] != prefix or parts[2] != BASE_MANIFEST or not _ATTEMPT.match(parts[1]):
        raise FormatError(f"{where}: the {prefix} manifest is not {prefix}/<attempt>/{BASE_MANIFEST}")
    return StoredObject(entry["manifest"], *_size_and_checksum(entry, f"{where}: the {prefix}"))


def base_files(obj: Any, where: str, required: str = "config.json") -> dict[str, StoredObject]:
    """The base manifest's objects: plain file names (config, tokenizer, weights; or an adapter's
    config and tensors) with sizes and checksums, ``required`` among them."""
    if not isinstance(obj, dict) or not isinstance(obj.get("objects"), dict) or len(obj["objects"]) > MAX_OBJECTS:
        raise FormatError(f"{where}: the base manifest must hold an 'objects' object")
    files = {}
    for name, entry in obj["objects"].items():
        if not isinstance(name, str) or not re.match(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,200}$", name) or name == BASE_MANIFEST:
            raise FormatError(f"{where}: the base names file {str(name)[:200]!r}, not a plain file name")
        if not isinstance(entry, dict):
            raise FormatError(f"{where}: the base's {name!r} entry is not an object")
        files[name] = StoredObject(name, *_size_and_checksum(entry, f"{where}: {name!r}"))
    if required not in files:
        raise FormatError(f"{where}: the base holds no {required}")
    return files


def parse_objects(obj: Any, weight_files: set[str], where: str) -> dict[str, StoredObject]:
    """A manifest's ``objects``: every file its ``weight_map`` names, each a plain name with a size
    and checksum."""
    if not isinstance(obj, dict) or len(obj) > MAX_OBJECTS:
        raise FormatError(f"{where}: the manifest's 'objects' must be an object of at most {MAX_OBJECTS} entries")
    objects = {}
    for name, entry in obj.items():
        check_payload_name(name, where)
        if not isinstance(entry, dict):
            raise FormatError(f"{where}: object {name!r}'s entry is not an object")
        objects[name] = StoredObject(name, *_size_and_checksum(entry, f"{where}: object {name!r}"))
    unlisted = sorted(weight_files - objects.keys())
    if unlisted:
        raise FormatError(f"{where}: the weight_map names files the manifest does not list: {unlisted[:5]}")
    return objects


def _size_and_checksum(entry: dict, where: str) -> tuple[int, str]:
    size, digest = entry.get("bytes"), entry.get("checksum")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_OBJECT_BYTES:
        raise FormatError(f"{where}: 'bytes' must be an integer in 0..{MAX_OBJECT_BYTES}")
    if not isinstance(digest, str) or not _HEX.match(digest):
        raise FormatError(f"{where}: 'checksum' must be a {OBJECT_CHECKSUM} hex digest")
    return size, digest
