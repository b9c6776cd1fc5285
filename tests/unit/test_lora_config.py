"""miles' LoRA flags: their defaults and meaning, the targets they resolve to, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_disagg.config.loader import load_config
from miles_disagg.config.lora_rules import resolve_targets
from miles_disagg.types import ConfigError

DISK_DELTA = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/tmp/d",
              "--update-weight-local-checkpoint-dir", "/tmp/l"]


def run(tmp_path: Path, *extra: str):
    return load_config(DISK_DELTA + ["--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", *extra],
                       "train_async")[0]


def test_miles_defaults_and_a_lora_run_on_disk_delta(tmp_path: Path) -> None:
    train = run(tmp_path).train
    assert (train.lora_rank, train.lora_alpha, train.lora_dropout, train.target_modules, train.exclude_modules,
            train.lora_adapter_path, train.lora_train_only) == (0, 16, 0.0, None, None, None, False)
    train = run(tmp_path, "--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear",
                "--lora-dropout", "0.1", "--lora-train-only").train
    assert (train.lora_rank, train.lora_alpha, train.lora_dropout, train.lora_train_only) == (8, 16, 0.1, True)


@pytest.mark.parametrize("targets, exclude, expected", [
    (None, None, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("attn", None, ("q_proj", "k_proj", "v_proj", "o_proj")),
    ("down_proj,q_proj", None, ("q_proj", "down_proj")),
    ("attn,up_proj", "k_proj", ("q_proj", "v_proj", "o_proj", "up_proj")),
    ("all-linear", "mlp", ("q_proj", "k_proj", "v_proj", "o_proj")),
])
def test_targets_resolve_as_miles_names_them(targets, exclude, expected) -> None:
    assert resolve_targets(targets, exclude) == expected


@pytest.mark.parametrize("extra, fragment, flags", [
    (["--lora-rank", "8", "--target-modules", "lm_head"], "output head", ("--target-modules",)),
    (["--lora-rank", "8", "--target-modules", "qkv"], "not a LoRA target", ("--target-modules",)),
    (["--lora-rank", "8", "--target-modules", "q_proj,", ], "empty entry", ("--target-modules",)),
    (["--lora-rank", "8", "--target-modules", "q_proj,v_proj", "--exclude-modules", "v_proj"], "takes them out",
     ("--target-modules", "--exclude-modules")),
    (["--lora-rank", "8", "--target-modules", "attn", "--exclude-modules", "attn"], "no adapter is left",
     ("--target-modules", "--exclude-modules")),
    (["--target-modules", "attn"], "--lora-rank is 0", ("--target-modules", "--lora-rank")),
    (["--lora-adapter-path", "/x"], "also when loading an adapter", ("--lora-adapter-path", "--lora-rank")),
    (["--lora-train-only"], "--lora-rank is 0", ("--lora-train-only", "--lora-rank")),
    (["--lora-rank", "8", "--train-backend", "megatron"], "use --train-backend fsdp", ("--lora-rank", "--train-backend")),
    (["--lora-rank", "8", "--lora-alpha", "0"], "--lora-alpha must be > 0", ("--lora-alpha",)),
])
def test_lora_refusals_name_the_flags(tmp_path: Path, extra, fragment, flags) -> None:
    with pytest.raises(ConfigError) as info:
        run(tmp_path, *extra)
    assert fragment in str(info.value)
    assert set(flags) <= set(info.value.flags) or all(f in str(info.value) for f in flags)
    assert "\n" not in str(info.value)
