"""Training checkpoints: written atomically, found again after a crash.

Layout under ``--save DIR``::

    iter_0000004/            one complete save (the step to run next is 4)
      rank0.pt ...           each trainer rank's backend state (model, optimizer, RNG)
      hf/                    optional HF export of the policy (transformers and engines load it)
      meta.json              written last: step, version, run_id, data position, and the size of
                             every file above (a save whose files do not match is not complete)
    .iter_0000006.partial/   a save being written (never loaded; removed by the next save)

A save is written into its ``.partial`` directory, fsynced, then renamed into place, so a
crash at any point leaves the previous saves as they were. ``find_latest`` returns the
newest save whose ``meta.json`` parses and whose files all have the recorded sizes.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from miles_disagg.types import ConfigError

META_NAME = "meta.json"
PREFIX = "iter_"


@dataclass
class SaveMeta:
    step: int  # the next step to run
    version: int  # the policy version the saved weights are (the trainer's last publication)
    run_id: str | None
    world_size: int
    data_position: int  # prompts consumed so far
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    extra: dict[str, Any] = field(default_factory=dict)


def save_name(step: int) -> str:
    return f"{PREFIX}{step:07d}"


def write_save(root: str | Path, meta: SaveMeta, write_files: Callable[[Path], None]) -> Path:
    """``write_files(partial_dir)`` writes the payload; then the meta, fsync, and rename."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / save_name(meta.step)
    partial = root / f".{save_name(meta.step)}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    write_files(partial)
    meta.files = {str(p.relative_to(partial)): p.stat().st_size for p in sorted(partial.rglob("*")) if p.is_file()}
    _write_synced(partial / META_NAME, json.dumps(asdict(meta), indent=2).encode())
    for path in partial.rglob("*"):
        if path.is_file():
            _fsync(path)
    if final.exists():
        shutil.rmtree(final)
    os.rename(partial, final)
    _fsync(root)
    return final


def find_latest(root: str | Path) -> tuple[Path, SaveMeta] | None:
    """The newest complete save under ``root`` (None if there is none)."""
    root = Path(root)
    if not root.is_dir():
        return None
    for path in sorted(root.glob(f"{PREFIX}*"), reverse=True):
        meta = read_complete(path)
        if meta is not None:
            return path, meta
    return None


def read_complete(path: Path) -> SaveMeta | None:
    """The save's meta when every recorded file is there with its size; else None."""
    try:
        raw = json.loads((path / META_NAME).read_text())
        meta = SaveMeta(**raw)
    except (OSError, ValueError, TypeError):
        return None
    for name, size in meta.files.items():
        if name == META_NAME:
            continue
        file = path / name
        if not file.is_file() or file.stat().st_size != size:
            return None
    return meta


def check_world_size(meta: SaveMeta, world_size: int, path: Path) -> None:
    if meta.world_size != world_size:
        raise ConfigError(f"--load {path.parent}: {path.name} was saved by {meta.world_size} trainer ranks; this job "
                          f"has {world_size}", ("--load", "--actor-num-gpus-per-node"))


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """fsync a file or a directory (its entries)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
