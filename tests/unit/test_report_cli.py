"""``miles-disagg report RUN_DIR`` rebuilds summary.json and report.png from a run's records at any time
(issue 29); what is not a run directory with records exits 2 with one line."""

from __future__ import annotations

import json
from pathlib import Path

from miles_disagg.cli import main
from miles_disagg.tracking import UPDATES_STREAM, MetricsTracker


def a_run(run_dir: Path, steps: int) -> Path:
    with MetricsTracker(run_dir) as tracker:
        for step in range(steps):
            tracker.log(step, {"rollout/raw_reward": 0.1 * step, "rollout/staleness_max": 1,
                               "perf/update_weights_wire_bytes": 2048, "perf/samples_per_s": 10.0})
            tracker.log_stream(UPDATES_STREAM, step, {"perf/update_weights_pause_time": 0.01})
    return run_dir


def test_the_report_is_rebuilt_from_the_records(tmp_path, capsys) -> None:
    run_dir = a_run(tmp_path / "run", 7)
    assert main(["report", str(run_dir)]) == 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 7 and summary["updates"] == 7
    assert summary["reward_window_steps"] == 3  # 7 steps: two windows of 3 that share no step
    assert abs(summary["reward_last"] - sum(0.1 * s for s in range(4, 7)) / 3) < 1e-9
    assert abs(summary["pause_time_mean_s"] - 0.01) < 1e-9  # the updates stream is joined in
    assert (run_dir / "report.png").stat().st_size > 1000
    assert "== run summary" in capsys.readouterr().err
    with MetricsTracker(run_dir, start_step=7) as tracker:  # more steps later: rebuilt again, any time
        tracker.log(7, {"rollout/raw_reward": 1.0})
    assert main(["report", str(run_dir)]) == 0
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 8


def test_what_is_not_a_run_directory_exits_2(tmp_path, capsys) -> None:
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert "has no metrics.jsonl" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "empty" / "summary.json").exists()


def test_hostile_records_exit_2(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 0, "rollout/staleness_max": "lots"}) + "\n"
                                           + "\x00\xff garbage\n" + "[" * 100000 + "\n")
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert "cannot be summarized" in err and "Traceback" not in err


def test_the_interruption_line_claims_only_what_was_written(tmp_path) -> None:
    import signal

    from miles_disagg.config import load_config
    from miles_disagg.loop.interrupts import RunInterrupted, report_interruption
    from miles_disagg.trainer.checkpoint import SaveMeta, write_save

    config, _ = load_config(["--hf-checkpoint", "x", "--run-dir", str(tmp_path / "run"), "--save",
                             str(tmp_path / "saves")], "train_async")
    (tmp_path / "run").mkdir()
    assert report_interruption(config, RunInterrupted(signal.SIGTERM)) == "interrupted (SIGTERM) at step 0"
    assert not (tmp_path / "run" / "summary.json").exists()
    a_run(tmp_path / "run", 3)
    write_save(tmp_path / "saves", SaveMeta(step=2, version=2, run_id="r", world_size=1, data_position=8,
                                            state_format="fsdp/torch-distributed-checkpoint"), lambda partial: (partial / "state").mkdir())
    line = report_interruption(config, KeyboardInterrupt())
    assert line == (f"interrupted (SIGINT) at step 3; summary.json and report.png of steps before 3 in {tmp_path / 'run'}; "
                    f"resume with --load {tmp_path / 'saves'}")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3


def test_an_error_after_a_signal_is_that_interruption() -> None:
    """Ctrl-C reaches the whole process group: a worker's error may beat the driver's own interrupt."""
    import signal

    from miles_disagg.loop.interrupts import RunInterrupted, exit_status, interrupted_by
    from miles_disagg.types import MilesDisaggError

    assert interrupted_by([], MilesDisaggError("engine died")) is None  # no signal: the error stands
    stands_for = interrupted_by([signal.SIGTERM], MilesDisaggError("engine died"))
    assert isinstance(stands_for, RunInterrupted) and exit_status(stands_for) == 143
    own = KeyboardInterrupt()
    assert interrupted_by([], own) is own and exit_status(own) == 130
