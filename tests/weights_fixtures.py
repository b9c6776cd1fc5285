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
                          encoding: str = "xor", checksum_format: str = "xxh3-128", ranks: int = 1) -> Path:
    """Write ``weight_vNNNNNN`` exactly as miles' disk-delta publisher does (no ``LATEST``).

    Per changed tensor ONE zstd frame (level 1, content size recorded, no frame checksum) of
    ``old ^ new`` (xor) or ``[u32 count][u32 byte positions][new bytes]`` (overwrite), stored as a
    1-D U8 tensor under the HF name by ``safetensors.numpy.save`` with ``__metadata__`` = {name:
    hex digest of the full new bytes}; one ``model-{i:05d}-of-{n:05d}.safetensors`` per writing
    rank that has changes (``ranks`` of them, round robin); every file written ``.tmp`` + rename,
    the index last, its metadata only ``version``/``base_version`` ("%06d"), ``delta_encoding``,
    ``compression_format`` ("zstd") and ``checksum_format``.
    """
    import safetensors.numpy
    import zstandard

    vdir = Path(store_dir) / f"weight_v{version:06d}"
    vdir.mkdir(parents=True)
    shards: list[tuple[dict[str, np.ndarray], dict[str, str]]] = [({}, {}) for _ in range(max(1, ranks))]
    for name in new:
        o, n = raw_bytes(old[name]), raw_bytes(new[name])
        mask = o != n
        if not mask.any():
            continue
        if encoding == "xor":
            delta = o ^ n
        else:
            pos = np.flatnonzero(mask).astype("<u4")
            delta = np.concatenate([np.array([pos.size], "<u4").view(np.uint8), pos.view(np.uint8), n[mask]])
        deltas, checksums = shards[sum(len(s[0]) for s in shards) % len(shards)]
        deltas[name] = np.frombuffer(zstandard.ZstdCompressor(level=1).compress(delta), dtype=np.uint8)
        checksums[name] = checksum(checksum_format, n)
    shards = [s for s in shards if s[0]]
    weight_map: dict[str, str] = {}
    for i, (deltas, checksums) in enumerate(shards):
        file_name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _atomic_write(vdir / file_name, safetensors.numpy.save(deltas, metadata=checksums))
        weight_map.update({name: file_name for name in deltas})
    index = {"metadata": {"version": f"{version:06d}", "base_version": f"{version - 1:06d}", "delta_encoding": encoding,
                          "compression_format": "zstd", "checksum_format": checksum_format},
             "weight_map": weight_map}
    _atomic_write(vdir / INDEX_NAME, json.dumps(index).encode())
    return vdir


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = Path(f"{path}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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


def make_target(base: Path, out: Path, seed: int, source: Path | None = None) -> Path:
    """A copy of ``source`` (default: base) whose MLP weights took a small step."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(base, out)
    tensors = load_file(str((source or base) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors = {k: v + 1e-3 * torch.randn(v.shape, generator=g) if ".mlp." in k else v for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
