"""Shared fixtures: tiny checkpoints made on the spot (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from session_files import made_once

import miles_disagg  # noqa: F401 - first: collection's imports of torch and ray run without the cyclic collector (startup.py)

REPO_ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["cpu_durations"]  # --cpu-durations=N

# Keep test processes from oversubscribing the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


TIERS = ("unit", "integration", "e2e", "sglang")
LAST_TIER = "sglang"  # importing SGLang changes process-wide state: nothing runs after it


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test carries the marker of its tier (its directory under tests/); ``slow`` tests start
    first and the SGLang tier runs last. Under ``--dist loadgroup`` the tests of a module that shares
    a module-scoped fixture (a whole run, a server) stay on one worker, so it is built once; every
    other test goes to whichever worker is free."""
    def tier(item: pytest.Item) -> str | None:
        parts = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts
        return parts[0] if parts and parts[0] in TIERS else None

    for item in items:
        if tier(item) is not None:
            item.add_marker(getattr(pytest.mark, tier(item)))
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=lambda item: (tier(item) == LAST_TIER, item.get_closest_marker("slow") is None))


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "package", "class") for defs in info.name2fixturedefs.values() for d in defs)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 (2 layers, hidden 64, float32) with a character-level tokenizer."""
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    return made_once(tmp_path_factory, "tiny_qwen3", make_tiny_qwen3)
