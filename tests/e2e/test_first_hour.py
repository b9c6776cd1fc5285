"""The first hour of a new user (issue 29), through train_async.py as a user runs it.

Mistakes are caught before anything starts: a missing ``--prompt-data`` and an unimportable
``--custom-rm-path`` exit 2 within seconds, with ``--dry-run`` and without, naming the flag, no
traceback, no Ray started. A run interrupted with Ctrl-C (SIGINT to its process group, as a
terminal sends it) at step N exits 130 with one line, leaves summary.json and report.png of the
steps before N, and ``--load`` continues it; while that resumed run holds the run directory a
second run on it exits 2 at once naming the holder, and the resumed run ends with every step's
record. Two whole runs carry every check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from base_model import place_base_model
from deadlines import scaled

from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)  # two whole runs in the module fixture (scaled by the load: e2e conftest)
QUIET_PREFLIGHT_S = 8.0  # a refused launch: Python, the config, the check; no Ray


def command(tmp: Path, num_rollout: int, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
            "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
            "--num-rollout", str(num_rollout), "--rollout-batch-size", "4", "--global-batch-size", "16",
            "--rollout-num-gpus", "1", "--save", str(tmp / "saves"), "--save-interval", "1",
            "--max-weight-staleness", "1000", *extra]


def environment(ray_tmp: str | None = None) -> dict[str, str]:
    return {**os.environ, "MILES_DISAGG_RAY_TMPDIR": ray_tmp or tempfile.mkdtemp(prefix="ray", dir="/tmp"),
            "RAY_AUTH_MODE": "disabled"}


@pytest.mark.parametrize("bad", [("--prompt-data", "/nonexistent.jsonl"), ("--custom-rm-path", "nosuch.mod:fn")])
def test_bad_paths_exit_2_within_seconds_before_ray(tmp_path: Path, digits_base_model: Path, bad: tuple[str, str]) -> None:
    place_base_model(digits_base_model, tmp_path)
    for mode in ([], ["--dry-run"]):
        ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
        start = time.monotonic()
        result = subprocess.run([*command(tmp_path, 2), *bad, *mode], cwd=tmp_path, env=environment(ray_tmp),
                                capture_output=True, text=True, timeout=scaled(120))
        took = time.monotonic() - start
        assert result.returncode == 2, result.stderr[-3000:]
        assert took < scaled(QUIET_PREFLIGHT_S), took
        assert bad[0] in result.stderr and bad[1] in result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert os.listdir(ray_tmp) == [], "Ray was started"
        assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def interrupted_then_resumed(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path):
    """A saving run gets Ctrl-C once it completed 3 steps; ``--load`` resumes it to 6 steps; while the
    resumed run holds the directory, a second run on it is started."""
    tmp = tmp_path_factory.mktemp("first-hour")
    place_base_model(digits_base_model, tmp)
    first = subprocess.Popen(command(tmp, 40), cwd=tmp, env=environment(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = tmp / "run" / "metrics.jsonl"
    deadline = time.monotonic() + scaled(240)
    while not (metrics.exists() and len(read_metrics(metrics)) >= 3 and find_latest(tmp / "saves")):
        assert first.poll() is None, first.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "3 steps were not logged in time"
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
    _, first_err = first.communicate(timeout=scaled(120))
    steps_at_interrupt = len(read_metrics(metrics))
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    report_size = (tmp / "run" / "report.png").stat().st_size

    resumed = subprocess.Popen(command(tmp, steps_at_interrupt + 3, "--load", str(tmp / "saves")), cwd=tmp,
                               env=environment(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lock = tmp / "run" / "run.lock"
    deadline = time.monotonic() + scaled(60)
    while not (lock.exists() and f'"pid": {resumed.pid},' in lock.read_text()):
        assert resumed.poll() is None, resumed.stderr.read()[-4000:]
        assert time.monotonic() < deadline, "the resumed run did not take the lock"
        time.sleep(0.05)
    records_before = metrics.read_bytes()
    start = time.monotonic()
    second = subprocess.run(command(tmp, 5), cwd=tmp, env=environment(), capture_output=True, text=True,
                            timeout=scaled(120))
    second_s = time.monotonic() - start
    assert metrics.read_bytes().startswith(records_before[:len(records_before) // 2])  # not truncated by the second
    _, resumed_err = resumed.communicate(timeout=scaled(300))
    return {"tmp": tmp, "first": (first.returncode, first_err, steps_at_interrupt, summary, report_size),
            "second": (second, second_s), "resumed": (resumed.returncode, resumed_err, steps_at_interrupt + 3)}


def test_ctrl_c_exits_130_with_one_line_and_the_report_of_completed_steps(interrupted_then_resumed) -> None:
    code, err, steps, summary, report_size = interrupted_then_resumed["first"]
    tmp = interrupted_then_resumed["tmp"]
    assert code == 130, err[-4000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert lines == [f"train_async.py: interrupted (SIGINT) at step {steps}; summary.json and report.png of steps "
                     f"before {steps} in {tmp / 'run'}; resume with --load {tmp / 'saves'}"], err[-3000:]
    assert summary["steps"] == steps and report_size > 1000


def test_a_second_run_on_a_held_run_dir_exits_2_at_once(interrupted_then_resumed) -> None:
    second, second_s = interrupted_then_resumed["second"]
    import socket

    assert second.returncode == 2, second.stderr[-3000:]
    assert "is in use by another run" in second.stderr and f"on host {socket.gethostname()}" in second.stderr
    assert "Traceback" not in second.stderr and second_s < scaled(QUIET_PREFLIGHT_S)


def test_load_continues_and_the_run_ends_with_every_steps_record(interrupted_then_resumed) -> None:
    code, err, total = interrupted_then_resumed["resumed"]
    tmp = interrupted_then_resumed["tmp"]
    assert code == 0, err[-6000:]
    assert "resuming from" in err
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(total))
    assert json.loads((tmp / "run" / "summary.json").read_text())["steps"] == total
    lock = json.loads((tmp / "run" / "run.lock").read_text())
    assert lock["released"] is True
