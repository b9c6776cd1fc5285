"""``--hf-checkpoint-init tiny-qwen3*`` with ``--seed``: the directory records how it was made;
an existing one is used only when it is what the flags ask for, else the run is refused (exit 2)
with what to do. Different seeds make different weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from miles_disagg.config import load_config
from miles_disagg.launcher import main
from miles_disagg.loop.preflight import ensure_base_checkpoint
from miles_disagg.models.tiny_qwen3 import INIT_RECORD_FILENAME, make_tiny_qwen3
from miles_disagg.types import ConfigError


def config_for(path: Path, seed: int, init: str = "tiny-qwen3-digits"):
    config, _ = load_config(["--hf-checkpoint", str(path), "--hf-checkpoint-init", init, "--seed", str(seed)],
                            "train_async")
    return config


def weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def test_seed_is_recorded_checked_and_changes_the_weights(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    ensure_base_checkpoint(config_for(a, seed=1))
    ensure_base_checkpoint(config_for(b, seed=2))
    record = json.loads((a / INIT_RECORD_FILENAME).read_text())["spec"]
    assert record["seed"] == 1 and record["charset"].startswith("0123456789")
    wa, wb = weights(a), weights(b)
    assert any(not wa[n].equal(wb[n]) for n in wa)  # the seed changes the initialisation
    before = (a / "model.safetensors").stat().st_mtime_ns
    ensure_base_checkpoint(config_for(a, seed=1))  # the same flags: used as it is
    assert (a / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match=r"was made with seed 1 \(this run asks for 2\).*remove it") as err:
        ensure_base_checkpoint(config_for(a, seed=2))
    assert "--seed" in err.value.flags
    with pytest.raises(ConfigError, match=r"charset digits \(this run asks for full\)"):
        ensure_base_checkpoint(config_for(a, seed=1, init="tiny-qwen3"))
    assert weights(a)["model.embed_tokens.weight"].equal(wa["model.embed_tokens.weight"])  # never replaced


def test_a_directory_not_made_by_the_init_is_refused_with_the_way_out(tmp_path: Path) -> None:
    plain = make_tiny_qwen3(tmp_path / "plain", seed=1)
    (plain / INIT_RECORD_FILENAME).unlink()
    with pytest.raises(ConfigError, match="no miles_disagg_init.json.*drop --hf-checkpoint-init"):
        ensure_base_checkpoint(config_for(plain, seed=1))
    config, _ = load_config(["--hf-checkpoint", str(plain)], "train_async")
    ensure_base_checkpoint(config)  # without --hf-checkpoint-init it is used as it is


def test_the_entry_point_exits_2_on_a_seed_mismatch(tmp_path: Path, capsys) -> None:
    made = make_tiny_qwen3(tmp_path / "base", seed=5)
    code = main("train_async", ["--hf-checkpoint", str(made), "--hf-checkpoint-init", "tiny-qwen3", "--seed", "6",
                                "--num-rollout", "1", "--rollout-batch-size", "1", "--actor-num-gpus-per-node", "1",
                                "--run-dir", str(tmp_path / "run")])
    assert code == 2
    assert "was made with seed 5 (this run asks for 6)" in capsys.readouterr().err
