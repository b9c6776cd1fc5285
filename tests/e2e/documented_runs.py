"""Training commands the documentation shows that a whole-run test runs as its own run.

The README/docs test (``test_readme.py``) runs every training command the pages show, shortened to
two steps. A command listed here is already run whole by the named test, as the pages show it with
only flags appended (where the run goes, its base model, how many steps, what it records), so the
suite pays for one whole run of it, not two. Each of those tests builds its command line with
:func:`documented_argv`, which fails when no page shows that command any more; ``test_readme.py``
checks that every entry names a test that does.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RUN_BY: dict[str, str] = {
    "train_async.py --config configs/tiny_cpu.yaml": "tests/e2e/test_tiny_cpu_main_job.py",
    "train.py --config configs/tiny_cpu.yaml": "tests/e2e/test_train_sync.py",
    "train.py --config configs/tiny_cpu.yaml --colocate --update-weight-transfer-mode broadcast "
    "--actor-num-gpus-per-node 2 --rollout-num-gpus 2": "tests/e2e/test_train_sync.py",
    "train_async.py --config configs/tiny_cpu_multiturn.yaml": "tests/e2e/test_rollout_extensions.py",
}
"""Documented command (as the pages write it after ``python``) -> the test that runs it whole."""


def shown_commands() -> list[str]:
    """Every ``python train*.py ...`` line of the README's and docs' bash blocks (continuations joined,
    comments dropped), from ``train*.py`` on."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = []
    for page in pages:
        for block in re.findall(r"^```bash\n(.*?)^```", page.read_text(encoding="utf-8"), re.S | re.M):
            for line in block.replace("\\\n", " ").splitlines():
                argv = shlex.split(line, comments=True)
                for i, token in enumerate(argv[1:], start=1):
                    if token.endswith(("train.py", "train_async.py")) and argv[i - 1].startswith("python"):
                        found.append(shlex.join(argv[i:]))
    return found


def documented_argv(command: str) -> list[str]:
    """``[python, path/to/train*.py, ...]`` of a documented command of :data:`RUN_BY`, paths made
    absolute; fails the calling test when no page shows the command."""
    assert command in RUN_BY, f"{command!r} is not in documented_runs.RUN_BY"
    assert command in shown_commands(), f"no page of the README or docs shows `python {command}` any more"
    argv = shlex.split(command)
    absolute = [str(REPO / token) if (REPO / token).is_file() else token for token in argv]
    return [sys.executable, *absolute]
