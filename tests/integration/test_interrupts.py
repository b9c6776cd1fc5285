"""SIGTERM / SIGINT during a run (issue 29), in a real driver process with a real local Ray (``ray.init``
sets its own SIGTERM handler in the driver; the run's must win): exit 143 / 130, one line naming the
step, summary.json and report.png of the completed steps. The training loop is replaced by one that
logs two steps and then waits: what is checked is the launcher's handling, not training."""

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
from deadlines import scaled

pytestmark = pytest.mark.timeout(scaled(240))  # a local Ray and a driver per test: scaled by the load

DRIVER = """
import sys, time
from miles_disagg import launcher
from miles_disagg.loop import train_loops

def two_steps_then_wait(config):
    from miles_disagg.loop.ray_start import init_ray
    from miles_disagg.tracking import MetricsTracker, status
    owns = init_ray(1)  # a real local Ray: its SIGTERM handler is set in this process
    try:
        with MetricsTracker(config.tracking.run_dir) as tracker:
            for step in range(2):
                tracker.log(step, {"rollout/raw_reward": 0.5, "perf/samples_per_s": 1.0})
            status("two steps logged")
            time.sleep(600)
    finally:
        import ray
        if owns:
            ray.shutdown()

train_loops.run = two_steps_then_wait
sys.exit(launcher.main("train_async", sys.argv[1:]))
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_stops_the_run_with_one_line_and_the_report(tmp_path: Path, tiny_qwen3_dir: Path, signum, code) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, "--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "5",
                             "--rollout-batch-size", "4", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                             "--run-dir", str(run_dir)], env=env, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + scaled(120)
    while not lines or "two steps logged" not in lines[-1]:
        line = proc.stderr.readline()
        assert line or proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "".join(lines)[-3000:]
        lines.append(line)
    proc.send_signal(signum)
    rest = proc.stderr.read()
    assert proc.wait(timeout=scaled(60)) == code, rest[-3000:]
    assert "Traceback" not in rest, rest[-3000:]
    name = signal.Signals(signum).name
    assert rest.strip().splitlines()[-1] == (f"train_async.py: interrupted ({name}) at step 2; summary.json and "
                                             f"report.png of steps before 2 in {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["steps"], summary["ended"], summary["end_reason"]) == (2, "interrupted", f"interrupted ({name})")
    assert (run_dir / "report.png").stat().st_size > 1000
    assert json.loads((run_dir / "run.lock").read_text())["released"] is True
