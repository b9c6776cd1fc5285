"""The e2e tier's shared base model.

Every whole run of ``configs/tiny_cpu.yaml`` (or its multi-turn sibling) starts from the random
digits Qwen3 that ``--hf-checkpoint-init tiny-qwen3-digits --seed 1234`` makes. A run pointed at
it with ``--hf-checkpoint`` (another path than the config's own, so the config's init does not
apply: the directory is used as it is) skips making it, which saves each run about 3 CPU-seconds
of imports and initialisation. It is made once per test session (the test processes share it)
and copied into each run's directory; ``test_tiny_cpu_main_job`` still lets its run make its own
(``--hf-checkpoint-init`` on its command line), as a user's first run does.
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

