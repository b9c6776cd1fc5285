"""The SGLang conformance tier: our side judged by the real SGLang package's own code.

``scripts/setup.sh`` installs a pinned SGLang release (``scripts/sglang-tier.txt``) without its
GPU dependencies into ``<venv>/sglang-tier``, a directory outside the venv's site-packages;
this conftest puts it at the front of ``sys.path``. Where it is missing the tier skips with
the reason on a developer machine and fails in CI (``CI`` set), where it must run.

One environment fix, and only here: the torchvision wheel on PyPI is built against CUDA torch
and cannot load its C++ ops into the CPU torch; its meta registrations then fail on two op
names (``torchvision::nms``, ``torchvision::qnms``) that its C++ library would have declared.
We declare those two schemas (no kernels) before SGLang's import chain reaches torchvision
(``sglang.srt.configs`` imports ``torchvision.transforms``, pure Python); nothing here calls them.

Importing SGLang changes process-wide state (environment variables for its caches, the root
logger, uvloop's event-loop policy), so the suite runs this tier last (``tests/conftest.py``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TIER_DIR = Path(os.environ.get("MILES_DISAGG_SGLANG_TIER_DIR", Path(sys.prefix) / "sglang-tier"))
TORCHVISION_OPS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


def _declare_torchvision_ops() -> None:
    import torch

    for name, schema in TORCHVISION_OPS.items():
        if not hasattr(torch.ops.torchvision, name):
            torch.library.define(f"torchvision::{name}", schema)


def _where_sglang_is() -> str | None:
    """Why the tier cannot run (None: SGLang is installed). Cheap: imports nothing."""
    import importlib.util

    if (TIER_DIR / "sglang").is_dir() or importlib.util.find_spec("sglang") is not None:
        return None
    return f"SGLang is not installed (run scripts/setup.sh; expected it in {TIER_DIR})"


UNAVAILABLE = _where_sglang_is()
if UNAVAILABLE is not None and os.environ.get("CI"):
    raise RuntimeError(f"the SGLang conformance tier must run in CI: {UNAVAILABLE}")


def pytest_collection_modifyitems(config, items) -> None:
    if UNAVAILABLE is None:
        return
    skip = pytest.mark.skip(reason=UNAVAILABLE)
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def sglang_loaded() -> None:
    """Import SGLang's server args, request types and HTTP app (only when a tier test runs:
    the import changes process-wide state, and the tier runs last)."""
    if TIER_DIR.is_dir() and str(TIER_DIR) not in sys.path:
        sys.path.insert(0, str(TIER_DIR))
    try:
        _declare_torchvision_ops()
        import sglang.srt.entrypoints.http_server  # noqa: F401
        import sglang.srt.managers.io_struct  # noqa: F401
        import sglang.srt.server_args  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - the tier's reason
        reason = f"SGLang is installed but does not import: {type(exc).__name__}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture
def io_struct(sglang_loaded):
    from sglang.srt.managers import io_struct

    return io_struct


@pytest.fixture(scope="session")
def sglang(sglang_loaded, tiny_qwen3_dir):
    """SGLang's own HTTP app in this process with a fake tokenizer manager (see sglang_app.py)."""
    from sglang_app import SGLangApp

    app = SGLangApp(tiny_qwen3_dir)
    yield app
    app.stop()


@pytest.fixture
def manager(sglang):
    """The fake tokenizer manager behind SGLang's app, with nothing recorded yet, at version 0."""
    sglang.manager.received.clear()
    sglang.manager.tensors.clear()
    sglang.manager.version = "0"
    return sglang.manager
