"""scripts/test.sh's exit status: CI trusts it, so every pair of the two pytest runs' outcomes
is checked against a copy of the script whose setup and Python are stand-ins."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

FAKE_PYTHON = """#!/usr/bin/env bash
# stands in for .venv/bin/python -m pytest: the SGLang tier's run exits $RC_SGLANG, the main $RC_MAIN
# (and for tests/deadlines.py, which measures the load before the suite: a quiet machine)
[ "$1" = tests/deadlines.py ] && { echo 1.00; exit 0; }
for arg in "$@"; do
  [ "$arg" = tests/sglang ] && { echo sglang-tier-report; exit "$RC_SGLANG"; }
done
echo main-report
exit "$RC_MAIN"
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    (root / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "test.sh", root / "scripts" / "test.sh")
    _write_executable(root / "scripts" / "setup.sh", "#!/usr/bin/env bash\nexit 0\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    _write_executable(root / ".venv" / "bin" / "python", FAKE_PYTHON)
    return root


def _write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


@pytest.mark.parametrize(
    ("rc_main", "rc_sglang", "expected"),
    [
        (0, 0, 0),  # everything passed
        (0, 5, 0),  # the selection left no SGLang-tier test
        (1, 0, 1),  # a main-suite failure
        (0, 1, 1),  # an SGLang-tier failure
        (2, 1, 2),  # the first failure's status
        (5, 0, 1),  # an empty main selection is a failure
    ],
)
def test_exit_status_combines_both_runs(project, rc_main, rc_sglang, expected):
    env = {**{k: v for k, v in os.environ.items() if k != "MILES_DISAGG_TEST_LOAD_FACTOR"},  # measured, as by CI
           "RC_MAIN": str(rc_main), "RC_SGLANG": str(rc_sglang)}
    done = subprocess.run(
        ["bash", str(project / "scripts" / "test.sh"), "-q"],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == expected, done.stdout + done.stderr
    assert "main-report" in done.stdout
    assert "sglang-tier-report" in done.stdout
