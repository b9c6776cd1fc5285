"""``--hf-checkpoint-init tiny-qwen3-moe[-digits]`` makes a tiny Qwen3-MoE (4 experts, top 2); the
record check tells it from a dense one, and records written before MoE existed still count as dense."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.loop.preflight import ensure_base_checkpoint
from miles_disagg.models.tiny_qwen3 import INIT_RECORD_FILENAME
from miles_disagg.types import ConfigError
from test_base_checkpoint import config_for


def test_the_moe_init_makes_a_qwen3_moe_and_is_told_from_the_dense_one(tmp_path: Path) -> None:
    moe = tmp_path / "moe"
    ensure_base_checkpoint(config_for(moe, seed=1, init="tiny-qwen3-moe-digits"))
    config = json.loads((moe / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and (config["num_experts"], config["num_experts_per_tok"]) == (4, 2)
    ensure_base_checkpoint(config_for(moe, seed=1, init="tiny-qwen3-moe-digits"))  # the same flags: used
    with pytest.raises(ConfigError, match=r"num_experts 4 \(this run asks for 0\)"):
        ensure_base_checkpoint(config_for(moe, seed=1, init="tiny-qwen3-digits"))


def test_a_dense_record_from_before_moe_still_matches(tmp_path: Path) -> None:
    dense = tmp_path / "dense"
    ensure_base_checkpoint(config_for(dense, seed=1))
    path = dense / INIT_RECORD_FILENAME
    record = json.loads(path.read_text())
    for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        del record["spec"][key]
    path.write_text(json.dumps(record))
    ensure_base_checkpoint(config_for(dense, seed=1))
    with pytest.raises(ConfigError, match=r"num_experts 0 \(this run asks for 4\)"):
        ensure_base_checkpoint(config_for(dense, seed=1, init="tiny-qwen3-moe-digits"))
