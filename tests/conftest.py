"""Shared fixtures: tiny checkpoints made on the spot (no downloads)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from deadlines import LOAD_FACTOR
from ray_start import export_ray_test_environment, guard_ray_init
from session_files import made_once

export_ray_test_environment()  # before anything imports Ray: every Ray the tests start inherits them
import miles_disagg  # noqa: E402,F401 - first: collection's imports of torch and ray run without the cyclic collector (startup.py)

REPO_ROOT = Path(__file__).resolve().parents[1]
pytest_plugins = ["cpu_durations"]  # --cpu-durations=N

# The tests' processes and the runs they start take Ctrl-C as a terminal's foreground job does. A
# background job of a non-interactive shell (`nohup ./scripts/test.sh &`, some CI runners) starts
# with SIGINT ignored, which every child inherits: a run interrupted during its checks, before it
# installs its own handler, then never hears the signal (test_dry_run's Ctrl-C test waited out the
# 120 s engine wait and exited 2). A handler set here is reset to the default in each child it execs.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Keep test processes from oversubscribing the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


TIERS = ("unit", "integration", "e2e", "sglang")
LAST_TIER = "sglang"  # importing SGLang changes process-wide state: nothing runs after it
FIRST_TIERS = ("e2e", "integration")  # whole runs first, then servers and Ray sessions, then the unit tier
CHEAP_MODULE_FIXTURES = frozenset({"base_copy", "qwen3_4b_line", "qwen3_30b_line", "tokenizer_dir"})
"""Module-scoped fixtures that take well under a second to build (a config file, a tokenizer, a
copy of the tiny model): tests that share only these are spread over the workers (each builds its
own) instead of queueing on one."""


def _tier(item: pytest.Item) -> str | None:
    parts = Path(str(item.fspath)).relative_to(REPO_ROOT / "tests").parts
    return parts[0] if parts and parts[0] in TIERS else None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test carries the marker of its tier (its directory under tests/). Under ``--dist
    loadgroup`` the tests of a module that shares a costly module-scoped fixture (a whole run, a
    server, a Ray cluster) are one unit that stays on one worker, so it is built once; every other
    test goes to whichever worker is free. Units start longest first (``scripts/test.sh`` keeps
    this order: ``--no-loadscope-reorder``): see :func:`_start_order`. The SGLang tier runs last."""
    for item in items:
        if _tier(item) is not None:
            item.add_marker(getattr(pytest.mark, _tier(item)))
        if _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    items.sort(key=_start_order)
    _scale_timeouts(config, items)


def _scale_timeouts(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test's pytest timeout (its marker, else the ini's) scaled by the machine's measured
    load (``deadlines.LOAD_FACTOR``): a test takes two to three times longer on a busy machine, and
    a hang still fails (see tests/deadlines.py)."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        quiet = _quiet_timeout(item, default)
        if quiet > 0:
            item.add_marker(pytest.mark.timeout(quiet * LOAD_FACTOR), append=False)  # the closest marker now


def _quiet_timeout(item: pytest.Item, default: float = 0.0) -> float:
    """The pytest timeout a test declares for a quiet machine (its marker, else ``default``)."""
    marker = item.get_closest_marker("timeout")
    if marker is None:
        return default
    return float(marker.args[0] if marker.args else marker.kwargs.get("timeout", default))


def _start_order(item: pytest.Item) -> tuple:
    """The e2e tier's whole runs first, then the integration tier, then the unit tier (its tests
    take a second or less: they fill the workers' gaps at the end); within a tier ``slow`` tests
    first, a module's unit (its tests run one after the other) before a single test, then the
    longer pytest timeout (the quiet value a test declares: how long it may take)."""
    tier = _tier(item)
    timeout = _quiet_timeout(item)
    rank = FIRST_TIERS.index(tier) if tier in FIRST_TIERS else len(FIRST_TIERS)
    return (tier == LAST_TIER, rank, item.get_closest_marker("slow") is None,
            item.get_closest_marker("xdist_group") is None, -timeout)


def _shares_a_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False
    return any(d.scope in ("module", "package", "class") and name not in CHEAP_MODULE_FIXTURES
               for name, defs in info.name2fixturedefs.items() for d in defs)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A session that runs tests past the unit tier starts Ray: this process's ``ray.init`` takes
    a start turn and retries a start that timed out (``tests/ray_start.py``)."""
    if any(_tier(item) in FIRST_TIERS for item in session.items):
        guard_ray_init()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Qwen3 (2 layers, hidden 64, float32) with a character-level tokenizer."""
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    return made_once(tmp_path_factory, "tiny_qwen3", make_tiny_qwen3)
