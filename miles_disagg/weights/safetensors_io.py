"""Minimal safetensors reading/writing at the byte level (no tensor library needed).

Delta application patches raw tensor bytes in place, so it needs each tensor's exact
byte range; the header is parsed here and validated against the file size, which turns
a truncated file into a ``FormatError`` instead of a short read.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from miles_disagg.types import FormatError
from miles_disagg.weights.jsonio import load_json

# safetensors dtype code -> bytes per element
DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: layout and absolute byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte
    nbytes: int

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


def read_header(path: str | Path) -> SafetensorsHeader:
    """Parse and validate a safetensors header; ``FormatError`` if missing, truncated or malformed."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw_len = f.read(8)
            if len(raw_len) != 8:
                raise FormatError(f"{path}: truncated safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", raw_len)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise FormatError(f"{path}: truncated or corrupt safetensors header (length {header_len}, file {size} bytes)")
            raw_header = f.read(header_len)
    except FileNotFoundError:
        raise FormatError(f"payload file {path} is missing") from None
    header = load_json(raw_header, f"{path}: safetensors header")
    if not isinstance(header, dict):
        raise FormatError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    tensors = {name: _parse_entry(path, name, info, data_start, size) for name, info in header.items()}
    if not isinstance(metadata, dict):
        raise FormatError(f"{path}: __metadata__ is not a JSON object")
    return SafetensorsHeader(path, tensors, {str(k): str(v) for k, v in metadata.items()})


def _parse_entry(path: Path, name: str, info: object, data_start: int, size: int) -> TensorEntry:
    try:
        dtype = info["dtype"]  # type: ignore[index]
        shape = tuple(int(d) for d in info["shape"])  # type: ignore[index]
        begin, end = (int(x) for x in info["data_offsets"])  # type: ignore[index]
        if any(d < 0 for d in shape):
            raise ValueError("negative dimension")
    except (KeyError, TypeError, ValueError, OverflowError):
        raise FormatError(f"{path}: malformed header entry for tensor {name!r}") from None
    if dtype not in DTYPE_ITEMSIZE:
        raise FormatError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= begin <= end or end - begin != numel * DTYPE_ITEMSIZE[dtype]:
        raise FormatError(f"{path}: tensor {name!r} byte range [{begin}, {end}) does not match {dtype}{list(shape)}")
    if data_start + end > size:
        raise FormatError(f"{path}: truncated: tensor {name!r} ends at byte {data_start + end}, file has {size}")
    return TensorEntry(name, dtype, shape, data_start + begin, end - begin)


def read_bytes(path: str | Path, entry: TensorEntry) -> bytearray:
    """Read one tensor's raw bytes into a fresh writable buffer."""
    buf = bytearray(entry.nbytes)
    with open(path, "rb", buffering=0) as f:
        f.seek(entry.offset)
        got = f.readinto(buf)
    if got != entry.nbytes:
        raise FormatError(f"{path}: truncated while reading tensor {entry.name!r}")
    return buf


def write_file(path: str | Path, tensors: Mapping[str, tuple[str, tuple[int, ...], object]],
               metadata: Mapping[str, str] | None = None, *, fsync: bool = True) -> int:
    """Write ``{name: (dtype, shape, buffer)}`` as a safetensors file; return its size in bytes.

    Tensors are laid out in the given order; the header is padded to 8 bytes as the
    reference implementation does, so ``safetensors`` itself reads the file.
    """
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    buffers = []
    for name, (dtype, shape, buf) in tensors.items():
        view = memoryview(buf).cast("B")  # type: ignore[arg-type]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
        buffers.append(view)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for view in buffers:
            f.write(view)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return 8 + len(encoded) + offset


def checkpoint_tensors(ckpt_dir: str | Path) -> dict[str, tuple[str, TensorEntry]]:
    """``{tensor name: (file name, entry)}`` over every ``*.safetensors`` file of a checkpoint dir."""
    found: dict[str, tuple[str, TensorEntry]] = {}
    for path in sorted(Path(ckpt_dir).glob("*.safetensors")):
        for name, entry in read_header(path).tensors.items():
            if name in found:
                raise FormatError(f"tensor {name!r} appears in both {found[name][0]} and {path.name} of {ckpt_dir}")
            found[name] = (path.name, entry)
    if not found:
        raise FormatError(f"no *.safetensors files in checkpoint directory {ckpt_dir}")
    return found


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
