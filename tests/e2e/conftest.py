"""The e2e tier's shared base model.

Every whole run of ``configs/tiny_cpu.yaml`` (or its multi-turn sibling) starts from the random
digits Qwen3 that ``--hf-checkpoint-init tiny-qwen3-digits --seed 1234`` makes. A run pointed at
it with ``--hf-checkpoint`` (another path than the config's own, so the config's init does not
apply: the directory is used as it is) skips making it, which saves each run about 3 CPU-seconds
of imports and initialisation. It is made once per test session (the test processes share it)
and copied into each run's directory; ``test_tiny_cpu_main_job`` still lets its run make its own
(``--hf-checkpoint-init`` on its command line), as a user's first run does.

Pytest timeouts of this tier are scaled by the machine's measured load (``tests/deadlines.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from session_files import made_once

BASE_SEED = 1234  # configs/tiny_cpu.yaml's seed


@pytest.fixture(scope="session")
def digits_base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_disagg.models.tiny_qwen3 import CHARSETS, make_tiny_qwen3

    return made_once(tmp_path_factory, "digits-base",
                     lambda path: make_tiny_qwen3(path, seed=BASE_SEED, charset=CHARSETS["digits"]))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every e2e test's pytest timeout (its marker, else the ini's) scaled by the machine's measured
    load (``deadlines.LOAD_FACTOR``): whole runs take two to three times longer on a busy machine,
    and a hang still fails (see tests/deadlines.py)."""
    from deadlines import LOAD_FACTOR

    here = Path(__file__).parent
    default = float(config.getini("timeout") or 0)
    for item in items:
        if not Path(str(item.fspath)).is_relative_to(here):
            continue
        marker = item.get_closest_marker("timeout")
        quiet = float(marker.args[0]) if marker and marker.args else float(marker.kwargs.get("timeout", default)) \
            if marker else default
        if quiet > 0:
            item.add_marker(pytest.mark.timeout(quiet * LOAD_FACTOR), append=False)  # the closest marker now
