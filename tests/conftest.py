"""Shared fixtures: tiny checkpoints made on the spot (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

# Keep test processes from oversubscribing the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


TIERS = ("unit", "integration", "e2e", "sglang")
LAST_TIER = "sglang"  # importing SGLang changes process-wide state: nothing runs after it


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries the marker of its tier (its directory under tests/); the SGLang tier runs last."""
    def tier(item: pytest.Item) -> str | None:
        parts = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts
        return parts[0] if parts and parts[0] in TIERS else None

    for item in items:
        if tier(item) is not None:
            item.add_marker(getattr(pytest.mark, tier(item)))
    items.sort(key=lambda item: tier(item) == LAST_TIER)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 (2 layers, hidden 64, float32) with a character-level tokenizer."""
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3") / "model")
