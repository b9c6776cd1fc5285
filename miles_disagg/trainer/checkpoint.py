"""Training checkpoints: written atomically, found again after a crash, loadable by any rank count.

Layout under ``--save DIR``::

    iter_0000004/            one complete save (the step to run next is 4)
      state/                 model and optimizer, sharded by the trainer ranks but laid out
                             independently of their number (fsdp: torch.distributed.checkpoint;
                             megatron: megatron-core dist_checkpointing), a directory of files
      rng/rank0.pt ...       each trainer rank's generator state (``trainer/rank_state.py``)
      hf/                    optional HF export of the policy (transformers and engines load it)
      meta.json              written last: step, version, run_id, data position, the number of
                             ranks that wrote the save, the state's format, and the size of every
                             file above (a save whose files do not match is not complete)
    .iter_0000006.partial/   a save being written (never loaded; removed by the next save)

A save is written into its ``.partial`` directory, every file and directory fsynced, then
renamed into place, so a crash at any point leaves the previous saves as they were.
``find_latest`` returns the newest save whose ``meta.json`` parses and whose files all have
the recorded sizes. A save written by N trainer ranks resumes with M (``check_world_size``
only reports the change); it must have been written by the same ``--train-backend``.
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
    state_format: str = ""  # how state/ was written (STATE_FORMATS); "" for saves of the older per-rank layout
    files: dict[str, int] = field(default_factory=dict)  # relative path -> size in bytes
    extra: dict[str, Any] = field(default_factory=dict)


STATE_FORMATS = {"fsdp": "fsdp/torch-distributed-checkpoint", "megatron": "megatron/dist-checkpointing"}
"""The ``state/`` format each ``--train-backend`` writes and reads."""


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
    for path in partial.rglob("*"):  # files and the directories that name them (ranks write subdirectories)
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


def check_world_size(meta: SaveMeta, world_size: int) -> str | None:
    """A line describing a change of the trainer's rank count since the save, or None. Never
    refuses: the model and optimizer state reshard on load (``trainer/rank_state.py`` says
    what happens to per-rank RNG states)."""
    if meta.world_size == world_size:
        return None
    return (f"the save was written by {meta.world_size} trainer ranks, this job has {world_size}: model and "
            "optimizer state are resharded on load")


def check_state_format(meta: SaveMeta, train_backend: str, path: Path) -> None:
    """``ConfigError`` unless ``train_backend`` reads the save's ``state/``."""
    wanted = STATE_FORMATS[train_backend]
    if meta.state_format == wanted:
        return
    if not meta.state_format:
        raise ConfigError(f"--load {path.parent}: {path.name} holds per-rank files of an earlier miles-disagg "
                          f"(rank<r>.pt); this version reads saves whose state/ is {wanted}. Resume it with the "
                          "version that wrote it, or start from its hf/ export with --hf-checkpoint",
                          ("--load", "--hf-checkpoint"))
    saved_by = next((name for name, fmt in STATE_FORMATS.items() if fmt == meta.state_format), meta.state_format)
    raise ConfigError(f"--load {path.parent}: {path.name} was written by --train-backend {saved_by}; this job has "
                      f"--train-backend {train_backend}", ("--load", "--train-backend"))


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
