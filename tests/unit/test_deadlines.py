"""The suite's deadline multiple (``tests/deadlines.py``): measured from the others' load, before the
suite starts, and passed to its test processes by ``scripts/test.sh``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import LOAD_FACTOR_ENV, MAX_LOAD_FACTOR, factor_for, runnable_others

SCRIPT = Path(__file__).resolve().parents[1] / "deadlines.py"


def test_the_factor_grows_with_the_others_load_per_core_up_to_its_cap() -> None:
    assert factor_for(0.0, 2) == 1.0
    assert factor_for(2.0, 2) == 3.0  # two busy processes on two cores: whole runs took about 3x
    assert factor_for(1.0, 4) == 1.5
    assert factor_for(100.0, 2) == MAX_LOAD_FACTOR


def test_a_busy_process_counts_as_runnable_at_once() -> None:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        assert runnable_others(samples=5, interval_s=0.05) >= 1
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.parametrize("given, printed", [("2.5", "2.50"), ("9", f"{MAX_LOAD_FACTOR:.2f}"), ("0.3", "1.00")])
def test_the_script_prints_the_factor_the_user_set_within_bounds(given: str, printed: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], env={**os.environ, LOAD_FACTOR_ENV: given},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == printed, done.stderr


def test_the_script_measures_a_factor_when_none_is_set() -> None:
    env = {k: v for k, v in os.environ.items() if k != LOAD_FACTOR_ENV}
    done = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert 1.0 <= float(done.stdout) <= MAX_LOAD_FACTOR


def test_the_test_script_passes_the_factor_to_the_suite() -> None:
    text = (SCRIPT.parents[1] / "scripts" / "test.sh").read_text()
    assert f'{LOAD_FACTOR_ENV}="${{{LOAD_FACTOR_ENV}:-$(.venv/bin/python tests/deadlines.py)}}"' in text
    assert f"export {LOAD_FACTOR_ENV}" in text
