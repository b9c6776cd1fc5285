"""A tiny Qwen3-MoE (2 layers, 4 experts, top 2, float32, character tokenizer), made once per session."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from session_files import made_once

TINY_MOE = {"num_experts": 4, "num_experts_per_tok": 2}


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET, make_tiny_qwen3

    return made_once(tmp_path_factory, "tiny_qwen3_moe",
                     functools.partial(make_tiny_qwen3, charset=DIGITS_CHARSET, **TINY_MOE))
