"""report.png and the end-of-run summary: a title naming the run and its settings, units, stale drops,
and a colocated run's handoff instead of an empty pause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.loop.report import PLOTS, key_settings, report_title, write_report


def _run_dir(tmp_path: Path, records: list[dict], config: dict | None = None) -> Path:
    run = tmp_path / "run-1"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (run / "config.json").write_text(json.dumps(config))
    return run


CONFIG = {"entry": "train", "cluster": {"colocate": True, "rollout_num_gpus": 2, "rollout_num_gpus_per_engine": 1},
          "rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 4, "max_weight_staleness": None,
                      "rollout_backend": "builtin"},
          "weights": {"update_weight_transfer_mode": "broadcast"},
          "train": {"hf_checkpoint": "/models/tiny-base", "train_backend": "fsdp", "lr": 0.003}}


def test_a_colocated_run_reports_its_handoff_not_an_empty_pause(tmp_path: Path, capsys) -> None:
    records = [{"step": i, "rollout/raw_reward": 0.1 * i, "perf/colocate_engine_release_time": 0.02,
                "perf/colocate_trainer_onload_time": 0.03, "perf/update_weights_time": 0.05,
                "perf/update_weights_wire_bytes": 1000, "perf/update_weights_total_bytes": 1000,
                "perf/colocate_offloaded_bytes": 3 * 2**20} for i in range(3)]
    run = _run_dir(tmp_path, records, CONFIG)
    summary = write_report(run)
    printed = capsys.readouterr().err
    assert "pause: mean n/a" not in printed
    assert "handoff (colocated, mean per step): engines release 20.0 ms, trainer onload 30.0 ms, weights to " \
           "engines 50.0 ms, offloaded 3.0 MiB" in printed
    assert summary["colocate_update_time_mean_s"] == pytest.approx(0.05)
    assert json.loads((run / "summary.json").read_text())["colocate_offloaded_bytes_mean"] == 3 * 2**20
    assert (run / "report.png").stat().st_size > 10_000


def test_a_disaggregated_run_keeps_its_pause_line(tmp_path: Path, capsys) -> None:
    run = _run_dir(tmp_path, [{"step": 0, "perf/update_weights_pause_time": 0.01, "perf/update_weights_wire_bytes": 5,
                               "rollout/stale_groups_dropped": 3}])
    summary = write_report(run)
    printed = capsys.readouterr().err
    assert "pause: mean 10.0 ms" in printed and "handoff" not in printed
    assert "colocate_update_time_mean_s" not in summary and summary["stale_groups_dropped"] == 3
    assert report_title(run) == str(run)  # no config.json: the directory alone


def test_the_title_names_the_run_and_its_key_settings(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, [{"step": 0}], CONFIG)
    title = report_title(run)
    assert title.startswith(str(run) + "\n")
    assert key_settings(CONFIG) == ("train.py, model tiny-base, 8 prompts x 4 samples/step, staleness unbounded, "
                                    "colocated, 2 engine(s) (builtin), fsdp, lr 0.003")
    (run / "config.json").write_text("{not json")
    assert report_title(run) == str(run)  # a damaged config never stops the report


def test_every_panel_has_units_and_stale_drops_are_plotted() -> None:
    keys = [key for key, *_ in PLOTS]
    assert "rollout/stale_groups_dropped" in keys
    assert all(unit for _, _, unit, _ in PLOTS)


def _rewards_run(tmp_path: Path, num_steps: int) -> Path:
    return _run_dir(tmp_path, [{"step": i, "rollout/raw_reward": float(i), "rollout/staleness_max": 1.0,
                                "rollout/stale_groups_dropped": 2.0, "perf/update_weights_wire_bytes": 10.0,
                                "perf/update_weights_total_bytes": 40.0} for i in range(num_steps)])


@pytest.mark.parametrize("num_steps, line", [
    (12, "steps: 12   reward first 5: 2.000   last 5: 9.000"),
    (5, "steps: 5   reward first 2: 0.500   last 2: 3.500"),  # an interrupted or short run: no shared step
    (2, "steps: 2   reward first 1: 0.000   last 1: 1.000"),
    (1, "steps: 1   reward: 0.000 (one step: too short for a first and a last window)"),
])
def test_a_short_runs_windows_share_no_step_and_say_their_size(tmp_path: Path, capsys, num_steps, line) -> None:
    summary = write_report(_rewards_run(tmp_path, num_steps))
    printed = capsys.readouterr().err.splitlines()
    assert printed[1] == line
    window = min(5, num_steps // 2)
    assert summary["reward_window_steps"] == window and summary["reward_mean"] == (num_steps - 1) / 2
    assert printed[2] == f"staleness max: 1   stale groups dropped: {2 * num_steps}"


def test_counts_are_integers_in_summary_json(tmp_path: Path, capsys) -> None:
    run = _rewards_run(tmp_path, 3)
    write_report(run)
    saved = json.loads((run / "summary.json").read_text())
    for key, value in (("steps", 3), ("updates", 3), ("staleness_max", 1), ("stale_groups_dropped", 6),
                       ("total_bytes", 40), ("reward_window_steps", 1)):
        assert saved[key] == value and type(saved[key]) is int, (key, saved[key])
    assert "wire: 0.0 KiB of 0.0 KiB" in capsys.readouterr().err  # means and sizes stay as they were


def test_a_run_without_rewards_says_so(tmp_path: Path, capsys) -> None:
    summary = write_report(_run_dir(tmp_path, [{"step": 0}]))
    assert "steps: 1   reward: n/a" in capsys.readouterr().err
    assert summary["reward_first"] is None and summary["reward_window_steps"] == 0


def test_a_run_that_fails_leaves_summary_json_with_its_end_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    """``train_loops.run`` (its job replaced by one that logs two steps and then loses its engines, as the
    capacity watch raises it through Ray): ``summary.json`` of the two steps says how the run ended,
    nothing is printed but the error; ``miles-disagg report`` keeps the end reason when it rebuilds it."""
    from miles_disagg.config import load_config
    from miles_disagg.loop import train_loops
    from miles_disagg.tracking import MetricsTracker
    from miles_disagg.types import RolloutCapacityLost

    config, _ = load_config(["--hf-checkpoint", "x", "--run-dir", str(tmp_path / "run")], "train_async")
    (tmp_path / "run").mkdir()

    class RayWrapped(Exception):  # what a ray.get raises: the actor's error as its cause
        cause = RolloutCapacityLost("only 0 of 2 rollout engine(s) served for 31s")

    def two_steps_then_lose_the_engines(config) -> None:
        with MetricsTracker(config.tracking.run_dir) as tracker:
            for step in range(2):
                tracker.log(step, {"rollout/raw_reward": 0.5})
        raise RayWrapped("wrapped")

    monkeypatch.setattr(train_loops, "_run_job", two_steps_then_lose_the_engines)
    with pytest.raises(RayWrapped):
        train_loops.run(config)
    assert capsys.readouterr().err == ""
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["ended"], summary["steps"]) == ("failed", 2)
    assert summary["end_reason"] == "RolloutCapacityLost: only 0 of 2 rollout engine(s) served for 31s"
    assert rebuilt_end_reason(tmp_path / "run") == summary["end_reason"]

    monkeypatch.setattr(train_loops, "_run_job", lambda config: None)
    train_loops.run(config)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["ended"] == "completed"


def rebuilt_end_reason(run_dir: Path) -> str:
    from miles_disagg.cli import main

    assert main(["report", str(run_dir)]) == 0
    return json.loads((run_dir / "summary.json").read_text())["end_reason"]
