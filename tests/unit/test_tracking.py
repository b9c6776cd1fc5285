"""Tracking: JSONL per step, crash-tolerant reading, clear errors for missing backends."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from miles_disagg.tracking import MetricsTracker, read_metrics
from miles_disagg.types import ConfigError


def test_one_json_object_per_step(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path / "run") as tracker:
        tracker.log(1, {"perf/update_weights_density": 0.25, "rollout/staleness_max": 2})
        tracker.log(2, {"loss": math.nan, "reward": float("inf"), "note": "ok"})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["step"] == 1 and first["perf/update_weights_density"] == 0.25
    assert isinstance(first["wall_time"], float)
    assert second["loss"] is None and second["reward"] == "inf" and second["note"] == "ok"


def test_reading_skips_a_torn_last_line(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path) as tracker:
        tracker.log(1, {"x": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 2, "x"')  # a crash mid-write
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]


def test_appends_across_restarts(tmp_path: Path) -> None:
    for step in (1, 2):
        with MetricsTracker(tmp_path, start_step=step) as tracker:
            tracker.log(step, {"x": step})
    assert [r["x"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_a_resumed_run_logs_each_step_once(tmp_path: Path) -> None:
    """The first attempt logged steps 0-4 but saved after step 2; the resumed run redoes 3 and 4."""
    with MetricsTracker(tmp_path, start_step=0) as tracker:
        for step in range(5):
            tracker.log(step, {"attempt": 1})
    with MetricsTracker(tmp_path, start_step=3) as tracker:
        for step in range(3, 6):
            tracker.log(step, {"attempt": 2})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == [0, 1, 2, 3, 4, 5]  # in the file itself, not only as read back
    assert [json.loads(line)["attempt"] for line in lines] == [1, 1, 1, 2, 2, 2]
    from miles_disagg.loop.report import summarize

    assert summarize(read_metrics(tmp_path / "metrics.jsonl"))["steps"] == 6


def test_a_fresh_run_in_a_used_run_dir_starts_the_file_over(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path, start_step=0) as tracker:
        tracker.log(0, {"x": 1})
        tracker.log(1, {"x": 1})
    with MetricsTracker(tmp_path, start_step=0) as tracker:
        tracker.log(0, {"x": 2})
    assert [(r["step"], r["x"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(0, 2)]


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_wandb_asked_for_but_missing_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--use-wandb"):
        MetricsTracker(tmp_path, use_wandb=True)


def test_streams_are_separate_durable_jsonl_files(tmp_path: Path) -> None:
    with MetricsTracker(tmp_path) as tracker:
        tracker.log(0, {"x": 1.0})
        tracker.log_stream("train_steps", 0, {"train/ppo_kl": 0.0})
        tracker.log_stream("train_steps", 1, {"train/ppo_kl": 0.1})
        with pytest.raises(ValueError, match="identifier"):
            tracker.log_stream("../escape", 0, {})
    assert [r["train/ppo_kl"] for r in read_metrics(tmp_path / "train_steps.jsonl")] == [0.0, 0.1]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0]
