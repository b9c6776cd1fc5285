"""``train.py`` (synchronous: generate, train, update) driven as a user does, in three forms:
disk-delta with managed engines, training alone on saved rollouts, and colocated (memory handoff)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest
from deadlines import scaled
from documented_runs import documented_argv
from base_model import place_base_model

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
SMALL = ["--num-rollout", "3", "--rollout-batch-size", "8", "--global-batch-size", "32"]
SYNC = "train.py --config configs/tiny_cpu.yaml"  # the documented commands these runs are
COLOCATED = ("train.py --config configs/tiny_cpu.yaml --colocate --update-weight-transfer-mode broadcast "
             "--actor-num-gpus-per-node 2 --rollout-num-gpus 2")


def train_py(tmp: Path, name: str, *args: str, command: str = SYNC) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp / name
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}  # Ray socket paths must be short
    result = subprocess.run([*documented_argv(command), *SMALL, "--run-dir", str(run_dir),
                             "--hf-checkpoint", str(tmp / "base-model"), *args],
                            cwd=tmp, capture_output=True, text=True, timeout=scaled(240), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return run_dir, result


@pytest.fixture(scope="module")
def sync_run(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("sync")
    place_base_model(digits_base_model, tmp)
    run_dir, _ = train_py(tmp, "disk-delta", "--save-debug-rollout-data", str(tmp / "rollouts" / "{rollout_id}.jsonl"))
    return tmp, run_dir


def test_sync_samples_are_on_policy_and_engines_follow(sync_run) -> None:
    tmp, run_dir = sync_run
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert r["weights/version"] == r["step"] + 1
        assert r["weights/engine_versions"] == [str(r["step"] + 1)] * 2
        assert r["rollout/staleness_max"] == 0 and r["rollout/mixed_version_ratio"] == 0
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-3
    for step in range(3):
        for line in (tmp / "rollouts" / f"{step}.jsonl").read_text().splitlines():
            group = json.loads(line)
            assert {(s["weight_version_start"], s["weight_version_end"]) for s in group["samples"]} == {(step, step)}


def test_train_only_on_saved_rollouts(sync_run) -> None:
    tmp, _ = sync_run
    run_dir, result = train_py(tmp, "train-only", "--debug-train-only",
                               "--load-debug-rollout-data", str(tmp / "rollouts" / "{rollout_id}.jsonl"))
    assert "engines:" not in result.stderr  # nothing was launched
    records = read_metrics(run_dir / "metrics.jsonl")
    assert len(records) == 3 and all("train/loss" in r and "weights/version" not in r for r in records)
    saved = [json.loads(line) for line in (tmp / "rollouts" / "0.jsonl").read_text().splitlines()]
    rewards = [s["reward"] for g in saved for s in g["samples"]]
    assert records[0]["rollout/raw_reward"] == pytest.approx(sum(rewards) / len(rewards))


def test_colocated_memory_handoff(tmp_path: Path, digits_base_model: Path) -> None:
    """--colocate: engines release memory while the trainer trains, the trainer offloads while they
    generate, and the policy reaches them by /update_weights_from_tensor (shared memory on CPU)."""
    place_base_model(digits_base_model, tmp_path)
    run_dir, result = train_py(tmp_path, "colocate", "--num-rollout", "2", command=COLOCATED)
    assert "trainer [0, 1], engines [[0], [1]]" in result.stderr  # the engines share the trainer's bundles
    assert "broadcast group" not in result.stderr  # weights go by reference, not over a group
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["weights/engine_versions"] for r in records] == [["1", "1"], ["2", "2"]]
    for r in records:
        assert r["perf/update_weights_density"] == 1.0 and r["perf/update_weights_wire_bytes"] > 0
        assert r["perf/colocate_offloaded_bytes"] > r["perf/update_weights_wire_bytes"]  # params + optimizer state
        assert r["perf/colocate_engine_release_time"] > 0
        # the engines generated with exactly the weights the trainer handed over
        assert r["train/train_rollout_logprob_abs_diff"] < 1e-4
