"""The first hour of a new user (issue 29), through train_async.py as a user runs it.

Mistakes are caught before anything starts: a missing ``--prompt-data`` and an unimportable
``--custom-rm-path`` exit 2 within seconds, with ``--dry-run`` and without, naming the flag, no
traceback, no Ray started. No whole run here: Ctrl-C at step N (exit 130, one line, summary.json
and report.png of the steps before N), ``--load`` continuing it, and a second run on a held run
directory exiting 2 at once are checked on ``test_resume.py``'s runs, which go on to a crash and a
resume with another rank count."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from base_model import place_base_model
from deadlines import scaled
from run_flags import ONE_ENGINE


REPO = Path(__file__).resolve().parents[2]
QUIET_PREFLIGHT_S = 8.0  # a refused launch: Python, the config, the check; no Ray


def command(tmp: Path, num_rollout: int, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
            "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
            "--num-rollout", str(num_rollout), "--rollout-batch-size", "4", "--global-batch-size", "16",
            *ONE_ENGINE, "--save", str(tmp / "saves"), "--save-interval", "1",
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
