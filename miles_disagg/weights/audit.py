"""Read-only checks and summaries of a store: ``verify`` and ``inspect``.

``verify_version`` without a base checks what ``apply`` checks short of the final bytes: the
index, the lineage back to the base or an anchor, every payload file (present, not truncated,
consistent with the index) and every payload decoded as ``apply`` decodes it (every zstd frame
decompresses to the right size, every count and position of an ``overwrite`` or ``sparse``
payload fits its tensor: a payload labelled with another encoding than it was written in is
refused, as ``apply`` refuses it). With ``base_dir`` it also replays the chain in memory and
checks every changed tensor's final-state checksum.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from miles_disagg.types import FormatError, LayoutMismatch
from miles_disagg.weights.apply import LocalTensor, apply_version, load_payloads
from miles_disagg.weights.codec import decode_chunk, split_frames
from miles_disagg.weights.format import VersionIndex
from miles_disagg.weights.safetensors_io import DTYPE_ITEMSIZE, checkpoint_tensors, read_bytes
from miles_disagg.weights.store import VersionStore


def _check_payloads(index: VersionIndex, version_dir: Path, base_sizes: dict[str, tuple[int, int]] | None) -> int:
    """Decode every payload of a version as ``apply`` does, chunk by chunk onto zeroed scratch of the
    chunk's size (so every frame, count, position and size ``apply`` checks is checked here, each
    frame bounded by its tensor's size); return the number of tensors checked. Only the final
    checksums need the base: :func:`verify_version` checks them with ``base_dir``."""
    payloads = load_payloads(version_dir, index)
    for name, payload in payloads.items():
        nbytes, itemsize = _tensor_size(index, name, base_sizes)
        spec = index.tensor_codec(name)
        frames = split_frames(spec, payload.data, nbytes, itemsize, name)
        for (start, end), chunk_frames in zip(spec.chunks(nbytes, itemsize), frames):
            decode_chunk(spec, np.zeros(end - start, dtype=np.uint8), chunk_frames, itemsize, name)
    return len(payloads)


def _tensor_size(index: VersionIndex, name: str, base_sizes: dict[str, tuple[int, int]] | None) -> tuple[int, int]:
    """(nbytes, itemsize) of a changed tensor: the base checkpoint's when given (what a host would
    apply it onto), else the index's layout. A plain-format version records none: without the
    base there is nothing to bound its decompression by, so it is refused, not inflated blindly."""
    if base_sizes is not None:
        if name not in base_sizes:
            raise LayoutMismatch(f"version {index.version} changes tensor {name!r}, which the base checkpoint lacks")
        return base_sizes[name]
    layout = index.layouts.get(name)
    if layout is None:
        raise FormatError(f"version {index.version} (plain format) records no size for tensor {name!r}; give "
                          "--base-dir so its decompression is bounded by the base checkpoint's layout")
    return layout.nbytes, DTYPE_ITEMSIZE.get(layout.dtype, 1)


def verify_version(store: VersionStore, version: int | None = None, base_dir: str | Path | None = None,
                   num_workers: int = 2) -> dict[str, Any]:
    """Verify ``version`` (default latest) and its chain; raise a typed error on the first problem."""
    if version is None:
        latest = store.latest()
        if latest is None:
            raise FormatError(f"{store.display} holds no published version")
        version = latest.version
    plan = store.plan_chain(version, None)
    base_sizes = _base_sizes(Path(base_dir)) if base_dir is not None else None
    checked = {index.version: _check_payloads(index, store.version_files(index.version), base_sizes)
               for index in plan.versions}
    report: dict[str, Any] = {"version": version, "run_id": plan.versions[-1].run_id, "start": plan.start,
                              "chain": [i.version for i in plan.versions], "tensors_checked": checked,
                              "final_checksums_verified": False}
    if base_dir is not None:
        _replay_in_memory(store, plan.versions, Path(base_dir), num_workers)
        report["final_checksums_verified"] = True
    return report


def _base_sizes(base_dir: Path) -> dict[str, tuple[int, int]]:
    return {n: (e.nbytes, e.itemsize) for n, (_, e) in checkpoint_tensors(base_dir).items()}


def _replay_in_memory(store: VersionStore, versions: tuple[VersionIndex, ...], base_dir: Path, num_workers: int) -> None:
    tensors = checkpoint_tensors(base_dir)
    layouts = {n: LocalTensor(e.dtype, e.shape, e.nbytes, e.itemsize) for n, (_, e) in tensors.items()}
    buffers: dict[str, np.ndarray] = {}

    def target_of(name: str) -> np.ndarray:
        if name not in buffers:
            file_name, entry = tensors[name]
            buffers[name] = np.frombuffer(read_bytes(base_dir / file_name, entry), dtype=np.uint8)
        return buffers[name]

    with ThreadPoolExecutor(max(1, num_workers)) as pool:
        for index in versions:
            for _ in apply_version(pool, store.version_files(index.version), index, layouts, target_of):
                pass


def describe_store(store: VersionStore) -> dict[str, Any]:
    """Versions with sizes, density and lineage; problems are reported per version, not raised."""
    pointer = store.pointer()
    versions = []
    for number in store.visible_versions():
        entry: dict[str, Any] = {"version": number}
        try:
            index = store.read_index(number)
            wire = store.payload_bytes(index)
            changed, total = index.extra.get("changed_bytes"), index.extra.get("total_bytes")
            entry.update({
                "run_id": index.run_id, "base_version": index.base_version, "delta_encoding": index.delta_encoding,
                "filter": index.filter, "checksum_format": index.checksum_format, "num_changed_tensors": len(index.weight_map),
                "files": len(index.files()), "wire_bytes": wire, "foreign": index.foreign,
                "density": int(changed) / max(int(total), 1) if changed is not None and total is not None else None,
            })
        except Exception as exc:  # noqa: BLE001 - inspect reports, verify raises
            entry["error"] = str(exc)
        versions.append(entry)
    anchors = [v["version"] for v in versions if v.get("delta_encoding") == "full"]
    return {
        "store": store.display,
        "latest": None if pointer is None else {"run_id": pointer.run_id, "version": pointer.version},
        "versions": versions,
        "newest_anchor": anchors[-1] if anchors else None,
        "total_wire_bytes": sum(v.get("wire_bytes", 0) for v in versions),
    }
