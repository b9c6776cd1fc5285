"""Files the tests of one session share: made once, read by every test process."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """``make(path)`` once per test session, returning ``path``. Under pytest-xdist the workers share
    it: the first to ask makes it in the session's directory (under a file lock), the others wait and
    use it (a checkpoint costs a worker about 3.5 CPU-seconds). Tests only read what it holds."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # this session's directory, above each worker's own
    path, made = root / name / "model", root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not made.exists():
            shutil.rmtree(path.parent, ignore_errors=True)
            make(path)
            made.touch()
    return path
