"""Test helpers (no pytest import): tiny checkpoints, a foreign plain-format producer,
and a fingerprint of a host's held state to assert "nothing changed"."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from miles_disagg.weights.checksums import checksum
from miles_disagg.weights.format import INDEX_NAME
from miles_disagg.weights.safetensors_io import write_file


def write_checkpoint(out_dir: str | Path, tensors: Mapping[str, Any], *, config: bool = True) -> Path:
    """Write torch tensors as ``model.safetensors`` (plus a stub ``config.json``)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    if config:
        (out / "config.json").write_text(json.dumps({"model_type": "test"}))
    return out


def raw_bytes(tensor: Any) -> np.ndarray:
    from miles_disagg.weights.torch_bytes import tensor_bytes

    return tensor_bytes(tensor).copy()


def write_foreign_version(store_dir: str | Path, version: int, old: Mapping[str, Any], new: Mapping[str, Any], *,
                          encoding: str = "xor", checksum_format: str = "xxh3-128") -> Path:
    """Write ``weight_vNNNNNN`` the way another disk-delta producer does: one zstd frame per
    changed tensor, index metadata without this project's additions, no ``LATEST``."""
    import zstandard

    vdir = Path(store_dir) / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    payloads, checksums = {}, {}
    for name in new:
        o, n = raw_bytes(old[name]), raw_bytes(new[name])
        if np.array_equal(o, n):
            continue
        if encoding == "xor":
            delta = (o ^ n).tobytes()
        else:
            pos = np.flatnonzero(o != n).astype("<u4")
            delta = np.array([pos.size], "<u4").tobytes() + pos.tobytes() + n[pos].tobytes()
        payloads[name] = ("U8", (len(zstandard.ZstdCompressor(level=1).compress(delta)),),
                          zstandard.ZstdCompressor(level=1).compress(delta))
        checksums[name] = checksum(checksum_format, n)
    file_name = "model-00000-of-00001.safetensors"
    if payloads:
        write_file(vdir / file_name, payloads, checksums)
    index = {"metadata": {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": encoding,
                          "compression_format": "zstd", "checksum_format": checksum_format},
             "weight_map": {name: file_name for name in payloads}}
    (vdir / INDEX_NAME).write_text(json.dumps(index))
    return vdir


def fingerprint(local_dir: str | Path, store_dir: str | Path | None = None) -> dict[str, Any]:
    """What must not change when an update fails: the link, the state file, every held file, LATEST."""
    local = Path(local_dir)
    result: dict[str, Any] = {"link": os.readlink(local) if local.is_symlink() else None}
    state = local.parent / (local.name + ".slots") / "state.json"
    result["state"] = state.read_text() if state.exists() else None
    if local.exists():
        result["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(local.iterdir()) if p.is_file()}
    if store_dir is not None:
        latest = Path(store_dir) / "LATEST"
        result["LATEST"] = latest.read_text() if latest.exists() else None
    return result
