"""Atomic training saves: complete ones are found, torn or half-written ones are not."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_disagg.trainer.checkpoint import SaveMeta, check_world_size, find_latest, write_save
from miles_disagg.types import ConfigError


def save(root: Path, step: int, payload: bytes = b"x" * 100) -> Path:
    def write(partial: Path) -> None:
        (partial / "rank0.pt").write_bytes(payload)
        (partial / "hf").mkdir()
        (partial / "hf" / "model.safetensors").write_bytes(payload * 2)

    return write_save(root, SaveMeta(step=step, version=step, run_id="r", world_size=1, data_position=8 * step), write)


def test_newest_complete_save_wins(tmp_path: Path) -> None:
    save(tmp_path, 2)
    save(tmp_path, 4)
    path, meta = find_latest(tmp_path)
    assert path.name == "iter_0000004" and meta.step == 4 and meta.data_position == 32
    assert meta.files == {"hf/model.safetensors": 200, "rank0.pt": 100}


def test_a_truncated_save_is_ignored_for_the_previous_one(tmp_path: Path) -> None:
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    with open(newest / "rank0.pt", "r+b") as f:
        f.truncate(10)  # cut mid-write
    assert find_latest(tmp_path)[0].name == "iter_0000002"
    (newest / "rank0.pt").unlink()
    assert find_latest(tmp_path)[0].name == "iter_0000002"


def test_a_partial_save_is_never_found(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "absent") is None
    save(tmp_path, 2)
    (tmp_path / ".iter_0000004.partial").mkdir()
    (tmp_path / ".iter_0000004.partial" / "rank0.pt").write_bytes(b"half")
    (tmp_path / "iter_0000006").mkdir()  # no meta.json: not complete
    assert find_latest(tmp_path)[0].name == "iter_0000002"
    save(tmp_path, 4)  # the next save replaces the leftover partial
    assert not (tmp_path / ".iter_0000004.partial").exists()
    assert find_latest(tmp_path)[0].name == "iter_0000004"


def test_world_size_must_match(tmp_path: Path) -> None:
    path, meta = find_latest(save(tmp_path, 2).parent)
    check_world_size(meta, 1, path)
    with pytest.raises(ConfigError, match="saved by 1 trainer ranks; this job has 2"):
        check_world_size(meta, 2, path)
