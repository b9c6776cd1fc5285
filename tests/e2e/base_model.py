"""Placing the e2e tier's shared base model (``conftest.digits_base_model``) where a run looks for it."""

from __future__ import annotations

import shutil
from pathlib import Path


def place_base_model(base: Path, directory: Path) -> Path:
    """A copy of ``base`` at ``directory/base-model`` (where the runs' ``--hf-checkpoint`` points)."""
    target = Path(directory) / "base-model"
    if not target.exists():
        shutil.copytree(base, target)
    return target
