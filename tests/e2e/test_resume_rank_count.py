"""A run saved by one trainer rank resumes with two (issue 13): through train_async.py's real
command line, the step, the data position and the version stream continue."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from checkpoint_reading import read_state

from miles_disagg.loop.report import join_updates
from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest, read_complete
from miles_disagg.weights.store import VersionStore

REPO = Path(__file__).resolve().parents[2]
OPTIMIZER_STEPS_PER_ROLLOUT = 2  # tiny config: 256 samples per rollout, global batch 128
PROMPTS_PER_ROLLOUT = 32


def train_async(tmp: Path, num_rollout: int, num_ranks: int, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
               "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
               "--num-rollout", str(num_rollout), "--actor-num-gpus-per-node", str(num_ranks),
               "--save", str(tmp / "saves"), "--save-interval", "2",
               "--max-weight-staleness", "1000", *extra]  # no load-dependent stale drops: positions count exactly
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(command, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def one_rank_then_two(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("rank-count")
    train_async(tmp, 2, 1)
    first_save, first_meta = find_latest(tmp / "saves")
    at_save = VersionStore(tmp / "run" / "weight-updates").latest()
    resumed = train_async(tmp, 4, 2, "--load", str(tmp / "saves"))
    return tmp, first_save, first_meta, at_save, resumed



def test_the_one_rank_save_is_resumed_by_two_ranks(one_rank_then_two) -> None:
    tmp, first_save, first_meta, _, resumed = one_rank_then_two
    assert first_save.name == "iter_0000002" and first_meta.world_size == 1
    assert sorted(p.name for p in (first_save / "rng").iterdir()) == ["rank0.pt"]
    assert f"resuming from {first_save}" in resumed.stderr
    assert "written by 1 trainer ranks, this job has 2" in resumed.stderr
    final_save, final = find_latest(tmp / "saves")
    assert final_save.name == "iter_0000004" and final.world_size == 2
    assert sorted(p.name for p in (final_save / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]


def test_step_data_position_and_optimizer_continue(one_rank_then_two) -> None:
    tmp, first_save, first_meta, _, _ = one_rank_then_two
    assert [r["step"] for r in read_metrics(tmp / "run" / "metrics.jsonl")] == [0, 1, 2, 3]
    assert json.loads((tmp / "run" / "summary.json").read_text())["steps"] == 4
    final_save, final = find_latest(tmp / "saves")
    assert final.step == 4 and final.run_id == first_meta.run_id
    assert first_meta.data_position == 2 * PROMPTS_PER_ROLLOUT
    assert final.data_position == 4 * PROMPTS_PER_ROLLOUT  # every prompt consumed once across the resume
    steps = {int(value) for key, value in read_state(final_save)["optimizer"].items() if key.endswith(".step")}
    assert steps == {4 * OPTIMIZER_STEPS_PER_ROLLOUT}  # Adam's moments continued, not restarted


def test_the_version_stream_continues(one_rank_then_two) -> None:
    tmp, first_save, first_meta, at_save, resumed = one_rank_then_two
    store = VersionStore(tmp / "run" / "weight-updates")
    assert at_save.run_id == first_meta.run_id == store.latest().run_id
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    resumed_records = records[2:]
    if at_save.version == first_meta.version:  # the store holds the saved policy: no republish
        assert resumed_records[0]["weights/version"] == first_meta.version + 1
    else:  # it moved on after the save: the trainer's state republished as the next number first
        assert f"republished the trainer's state as full v{at_save.version + 1}" in resumed.stderr
        assert resumed_records[0]["weights/version"] == at_save.version + 2
    versions = [r["weights/version"] for r in records]
    assert versions == sorted(set(versions))  # never a number reused
    assert store.latest().version == versions[-1] == read_complete(find_latest(tmp / "saves")[0]).version
    joined = join_updates(records, read_metrics(tmp / "run" / "updates.jsonl"))  # activations are logged apart
    for record in joined[2:]:
        assert record["weights/engine_versions"] == [str(record["weights/version"])] * 2
