"""The version directory format: ``model.safetensors.index.json`` and its validation.

Index metadata written by this project (strings where other producers write strings)::

    version            "000007"           (required)
    base_version       "000006"           (required)
    delta_encoding     xor | overwrite | full | mixed
    compression_format zstd
    checksum_format    xxh3-128 | blake3 | adler32
    run_id             this project's addition ("" / absent for foreign producers)
    filter             byteplane | none   (absent: none, the plain format)
    chunk_bytes        byte-plane chunk size
    tensors            {name: {"dtype", "shape", "nbytes"[, "encoding"]}} for every changed tensor;
                       "encoding" (xor | overwrite | sparse) only where it is not the version's
                       delta_encoding: every tensor of a ``mixed`` version has one

``mixed`` (byteplane filter only) lets each tensor take the smallest of its encodings
(:mod:`miles_disagg.weights.mixed`). A reader that predates it refuses the version: its
``delta_encoding`` is not one it knows, so it fails with a ``FormatError`` instead of reading a
sparse payload as XOR planes.
    changed_bytes, total_bytes, created_unix   (inspection only)

A directory without the additions is read as the plain format (filter ``none``,
no layout list, empty run id). That is the layout miles' disk-delta publisher writes
and SGLang's /pull_weights applies: only the five keys above (``version`` and
``base_version`` as "%06d" strings, read here with ``int()`` so integers work too),
``weight_map`` naming ``model-{i:05d}-of-{n:05d}.safetensors`` files (one per writing
rank, possibly several), no ``LATEST``; an empty ``weight_map`` is a version that changed
nothing. An index without ``delta_encoding`` is an ordinary checkpoint, which SGLang
copies as a full version; it is refused here with a ``FormatError``, and so is a
``checksum_scope`` key (a fork's checksums of the compressed payload instead of the
tensor's final bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from miles_disagg.types import FormatError, VersionRef
from miles_disagg.weights.checksums import CHECKSUMS
from miles_disagg.weights.jsonio import load_json

INDEX_NAME = "model.safetensors.index.json"

ENCODINGS = ("xor", "overwrite", "full", "mixed")  # a version's delta_encoding
TENSOR_ENCODINGS = ("xor", "overwrite", "sparse")  # what one tensor of a ``mixed`` version may use
FILTERS = ("byteplane", "none")
COMPRESSIONS = ("zstd",)
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class CodecSpec:
    """How one version's payloads are encoded: delta encoding, filter and chunk size."""

    encoding: str = "xor"
    filter: str = "byteplane"
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS and self.encoding != "sparse":
            raise FormatError(f"unknown delta encoding {self.encoding!r} (known: {', '.join(ENCODINGS)})")
        if self.filter not in FILTERS:
            raise FormatError(f"unknown delta filter {self.filter!r} (known: {', '.join(FILTERS)})")
        if self.encoding in ("mixed", "sparse") and self.filter != "byteplane":
            raise FormatError(f"delta encoding {self.encoding!r} needs the byteplane filter, not {self.filter!r}")
        if self.chunk_bytes < 8:
            raise FormatError(f"chunk_bytes must be >= 8, got {self.chunk_bytes}")

    def for_tensor(self, encoding: str) -> "CodecSpec":
        """The spec one tensor's payload is read with: ``encoding`` is its per-tensor encoding
        from the index ("" = the version's). A ``mixed`` version needs one for every tensor."""
        if self.encoding != "mixed":
            if encoding not in ("", self.encoding):
                raise FormatError(f"a tensor's encoding {encoding!r} differs from the version's {self.encoding!r}")
            return self
        if encoding not in TENSOR_ENCODINGS:
            raise FormatError(f"a mixed version's tensor needs an encoding of {', '.join(TENSOR_ENCODINGS)}, "
                              f"got {encoding!r}")
        return CodecSpec(encoding, self.filter, self.chunk_bytes)

    def num_planes(self, itemsize: int) -> int:
        """Byte planes a chunk of ``itemsize``-byte elements is cut into: 2 for a 2-byte dtype
        under the byteplane filter, else 1."""
        return 2 if self.filter == "byteplane" and itemsize == 2 else 1

    def frames_per_chunk(self, itemsize: int) -> int:
        """Frames one chunk's payload holds: one per byte plane, one for a sparse chunk."""
        return 1 if self.encoding == "sparse" else self.num_planes(itemsize)

    def chunks(self, nbytes: int, itemsize: int) -> list[tuple[int, int]]:
        """Byte ranges the tensor is cut into (one range without the filter)."""
        if self.filter == "none":
            return [(0, nbytes)]
        step = max(itemsize, self.chunk_bytes - self.chunk_bytes % itemsize)
        return [(start, min(start + step, nbytes)) for start in range(0, max(nbytes, 1), step)]


@dataclass(frozen=True)
class TensorLayout:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    encoding: str = ""  # "": the version's delta_encoding

    def to_json(self, version_encoding: str) -> dict[str, Any]:
        entry: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "nbytes": self.nbytes}
        if self.encoding and self.encoding != version_encoding:
            entry["encoding"] = self.encoding
        return entry


@dataclass(frozen=True)
class VersionIndex:
    """A parsed, validated index of one version directory."""

    version: int
    base_version: int
    run_id: str
    delta_encoding: str
    compression_format: str
    checksum_format: str
    filter: str
    chunk_bytes: int
    weight_map: dict[str, str]
    layouts: dict[str, TensorLayout] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # other metadata keys, kept as read
    foreign: bool = False  # written by another producer (no ``run_id`` addition)

    @property
    def ref(self) -> VersionRef:
        return VersionRef(self.run_id, self.version)

    @property
    def base_ref(self) -> VersionRef:
        return VersionRef(self.run_id, self.base_version)

    @property
    def codec(self) -> CodecSpec:
        return CodecSpec(self.delta_encoding, self.filter, self.chunk_bytes)

    @property
    def encodings(self) -> dict[str, str]:
        """Per-tensor encodings recorded in the index (those of a ``mixed`` version)."""
        return {name: layout.encoding for name, layout in self.layouts.items() if layout.encoding}

    def tensor_codec(self, name: str) -> CodecSpec:
        """The spec tensor ``name``'s payload is read with (its own encoding in a ``mixed`` version)."""
        layout = self.layouts.get(name)
        try:
            return self.codec.for_tensor(layout.encoding if layout is not None else "")
        except FormatError as exc:
            raise FormatError(f"version {self.version}: tensor {name!r}: {exc}") from None

    def files(self) -> list[str]:
        return sorted(set(self.weight_map.values()))

    def to_json(self) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "version": f"{self.version:06d}",
            "base_version": f"{self.base_version:06d}",
            "delta_encoding": self.delta_encoding,
            "compression_format": self.compression_format,
            "checksum_format": self.checksum_format,
            "run_id": self.run_id,
            "filter": self.filter,
            "chunk_bytes": str(self.chunk_bytes),
            "tensors": {n: l.to_json(self.delta_encoding) for n, l in self.layouts.items()},
        }
        metadata.update(self.extra)
        return {"metadata": metadata, "weight_map": dict(self.weight_map)}


def check_payload_name(file_name: object, version_dir: str | Path = "") -> str:
    """A weight_map file name must be a plain file name inside the version directory."""
    if not isinstance(file_name, str) or not file_name:
        raise FormatError(f"weight_map of {version_dir} names a non-string or empty file {file_name!r}")
    pure = PurePosixPath(file_name)
    if pure.is_absolute() or "\\" in file_name or len(pure.parts) != 1 or file_name in (".", "..") or "\x00" in file_name:
        raise FormatError(f"weight_map of {version_dir} names file {file_name!r} outside the version directory")
    if not file_name.endswith(".safetensors"):
        raise FormatError(f"weight_map of {version_dir} names {file_name!r}, not a .safetensors file")
    return file_name


def _version_number(metadata: dict[str, Any], key: str, where: str) -> int:
    value = metadata.get(key)
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise FormatError(f"{where}: metadata {key!r} is {value!r}, not a version number")
    try:
        number = int(str(value), 10)
    except ValueError:
        raise FormatError(f"{where}: metadata {key!r} is {value!r}, not a version number") from None
    if number < 0:
        raise FormatError(f"{where}: metadata {key!r} is negative")
    return number


def _choice(metadata: dict[str, Any], key: str, known: tuple[str, ...], where: str, default: str | None = None) -> str:
    value = metadata.get(key, default)
    if not isinstance(value, str) or value not in known:
        raise FormatError(f"{where}: unknown {key} {value!r} (known: {', '.join(known)})")
    return str(value)


def _layouts(raw: Any, where: str) -> dict[str, TensorLayout]:
    if raw is None:
        return {}
    try:
        layouts = {str(n): TensorLayout(str(v["dtype"]), tuple(int(d) for d in v["shape"]), int(v["nbytes"]),
                                        _tensor_encoding(v.get("encoding", ""), str(n), where))
                   for n, v in raw.items()}
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
        raise FormatError(f"{where}: malformed per-tensor layout metadata") from None
    bad = next((n for n, l in layouts.items() if l.nbytes < 0 or any(d < 0 for d in l.shape)), None)
    if bad is not None:
        raise FormatError(f"{where}: tensor {bad!r} has a negative size in its layout metadata")
    return layouts


def _tensor_encoding(value: Any, name: str, where: str) -> str:
    if value != "" and value not in TENSOR_ENCODINGS:
        raise FormatError(f"{where}: tensor {name!r} has unknown encoding {value!r} (known: {', '.join(TENSOR_ENCODINGS)})")
    return str(value)


def _check_encodings(index: VersionIndex, where: str) -> None:
    """Every changed tensor is readable: a ``mixed`` version names each one's encoding."""
    try:
        index.codec
    except FormatError as exc:
        raise FormatError(f"{where}: {exc}") from None
    for name in index.weight_map:
        index.tensor_codec(name)


def parse_index(obj: Any, where: str) -> VersionIndex:
    """Validate a loaded index JSON object; ``FormatError`` naming the bad field."""
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict) or not isinstance(obj.get("weight_map"), dict):
        raise FormatError(f"{where}: index must hold 'metadata' and 'weight_map' objects")
    metadata: dict[str, Any] = obj["metadata"]
    if "delta_encoding" not in metadata:
        raise FormatError(
            f"{where}: index metadata has no 'delta_encoding': an ordinary (full) checkpoint, not a delta; "
            "full versions of other producers are not read here (use it as --base-dir instead)"
        )
    for key in ("version", "base_version", "delta_encoding", "compression_format", "checksum_format"):
        if key not in metadata:
            raise FormatError(f"{where}: index metadata lacks {key!r}")
    if metadata.get("checksum_scope") is not None:  # e.g. a fork's "compressed_delta"
        raise FormatError(f"{where}: checksum_scope {metadata['checksum_scope']!r} is not supported "
                          "(checksums here are of each tensor's full new bytes)")
    try:
        chunk_bytes = int(metadata.get("chunk_bytes", DEFAULT_CHUNK_BYTES))
    except (TypeError, ValueError, OverflowError):
        raise FormatError(f"{where}: chunk_bytes {metadata.get('chunk_bytes')!r} is not an integer") from None
    known_keys = {"version", "base_version", "delta_encoding", "compression_format", "checksum_format",
                  "run_id", "filter", "chunk_bytes", "tensors"}
    extra = {k: v for k, v in metadata.items() if k not in known_keys}
    index = VersionIndex(
        version=_version_number(metadata, "version", where),
        base_version=_version_number(metadata, "base_version", where),
        run_id=str(metadata.get("run_id") or ""),
        delta_encoding=_choice(metadata, "delta_encoding", ENCODINGS, where),
        compression_format=_choice(metadata, "compression_format", COMPRESSIONS, where),
        checksum_format=_choice(metadata, "checksum_format", CHECKSUMS, where),
        filter=_choice(metadata, "filter", FILTERS, where, default="none"),
        chunk_bytes=chunk_bytes,
        weight_map={str(n): check_payload_name(f, where) for n, f in obj["weight_map"].items()},
        layouts=_layouts(metadata.get("tensors"), where),
        extra=extra,
        foreign="run_id" not in metadata,
    )
    if index.chunk_bytes < 8:
        raise FormatError(f"{where}: chunk_bytes {index.chunk_bytes} is too small")
    _check_encodings(index, where)
    return index


def read_index(version_dir: Path) -> VersionIndex:
    """Read and validate ``version_dir/model.safetensors.index.json``."""
    path = version_dir / INDEX_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise FormatError(f"{version_dir} has no {INDEX_NAME}") from None
    index = parse_index(load_json(raw, path), str(version_dir))
    if version_dir.name.startswith("weight_v") and version_dir.name[len("weight_v"):].isdigit():
        if int(version_dir.name[len("weight_v"):]) != index.version:
            raise FormatError(f"{version_dir}: index says version {index.version}")
    return index
