"""Atomic training saves: complete ones are found, torn or half-written ones are not; a save
may be resumed by another number of ranks, never by another backend's format."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_disagg.trainer.checkpoint import (
    STATE_FORMATS, SaveMeta, check_state_format, check_world_size, find_latest, read_complete, write_save)
from miles_disagg.types import ConfigError


def save(root: Path, step: int, payload: bytes = b"x" * 100, world_size: int = 2) -> Path:
    """A save laid out as the trainer writes one: a DCP-style state/ directory (a hidden
    .metadata among its files), per-rank RNG files and an HF export."""
    def write(partial: Path) -> None:
        (partial / "state").mkdir()
        (partial / "state" / ".metadata").write_bytes(payload[:10])
        (partial / "rng").mkdir()
        for rank in range(world_size):
            (partial / "state" / f"__{rank}_0.distcp").write_bytes(payload)
            (partial / "rng" / f"rank{rank}.pt").write_bytes(payload[:20])
        (partial / "hf").mkdir()
        (partial / "hf" / "model.safetensors").write_bytes(payload * 2)

    return write_save(root, SaveMeta(step=step, version=step, run_id="r", world_size=world_size,
                                     data_position=8 * step, state_format=STATE_FORMATS["fsdp"]), write)


def test_newest_complete_save_wins(tmp_path: Path) -> None:
    save(tmp_path, 2)
    save(tmp_path, 4)
    path, meta = find_latest(tmp_path)
    assert path.name == "iter_0000004" and meta.step == 4 and meta.data_position == 32
    assert meta.files == {"hf/model.safetensors": 200, "state/.metadata": 10, "state/__0_0.distcp": 100,
                          "state/__1_0.distcp": 100, "rng/rank0.pt": 20, "rng/rank1.pt": 20}


def test_a_truncated_save_is_ignored_for_the_previous_one(tmp_path: Path) -> None:
    save(tmp_path, 2)
    newest = save(tmp_path, 4)
    with open(newest / "state" / "__1_0.distcp", "r+b") as f:
        f.truncate(10)  # one rank's shard cut mid-write
    assert find_latest(tmp_path)[0].name == "iter_0000002"
    (newest / "state" / "__1_0.distcp").write_bytes(b"x" * 100)
    assert find_latest(tmp_path)[0].name == "iter_0000004"
    (newest / "state" / ".metadata").unlink()  # DCP's index, a hidden file, is recorded too
    assert find_latest(tmp_path)[0].name == "iter_0000002"


def test_a_partial_save_is_never_found(tmp_path: Path) -> None:
    assert find_latest(tmp_path / "absent") is None
    save(tmp_path, 2)
    (tmp_path / ".iter_0000004.partial").mkdir()
    (tmp_path / ".iter_0000004.partial" / "state").mkdir(parents=True)
    (tmp_path / ".iter_0000004.partial" / "state" / "__0_0.distcp").write_bytes(b"half")
    (tmp_path / "iter_0000006").mkdir()  # no meta.json: not complete
    assert find_latest(tmp_path)[0].name == "iter_0000002"
    save(tmp_path, 4)  # the next save replaces the leftover partial
    assert not (tmp_path / ".iter_0000004.partial").exists()
    assert find_latest(tmp_path)[0].name == "iter_0000004"


def test_another_world_size_is_reported_not_refused(tmp_path: Path) -> None:
    path, meta = find_latest(save(tmp_path, 2).parent)
    assert check_world_size(meta, 2) is None
    assert "written by 2 trainer ranks, this job has 1" in check_world_size(meta, 1)


def test_the_state_format_must_be_the_backends(tmp_path: Path) -> None:
    path = save(tmp_path, 2)
    meta = read_complete(path)
    check_state_format(meta, "fsdp", path)
    with pytest.raises(ConfigError, match="written by --train-backend fsdp; this job has --train-backend megatron"):
        check_state_format(meta, "megatron", path)
    meta.state_format = ""  # a save of the per-rank layout (rank<r>.pt) of earlier versions
    with pytest.raises(ConfigError, match="per-rank files of an earlier miles-disagg"):
        check_state_format(meta, "fsdp", path)
