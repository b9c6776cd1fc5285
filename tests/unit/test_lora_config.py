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


LORA = ["--lora-rank", "8"]


@pytest.mark.parametrize("extra, entry, fragment, flag", [
    (["--colocate", "--update-weight-transfer-mode", "broadcast"], "train", "--colocate", "--colocate"),
])
def test_lora_topologies_that_cannot_serve_adapter_versions_are_refused(tmp_path: Path, extra, entry, fragment,
                                                                        flag) -> None:
    """Each topology whose engines would serve the merged policy (or the bare base) is one line naming what
    to use instead; --lora-train-only (the base is what it rolls out on) is not refused."""
    base = [] if "--colocate" in extra else DISK_DELTA
    args = base + ["--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", *LORA, *extra]
    with pytest.raises(ConfigError) as info:
        load_config(args, entry)
    assert fragment in str(info.value) and flag in info.value.flags and "\n" not in str(info.value)
    assert "engines the job launches or attached ones" in str(info.value) or "disk-delta" in str(info.value)
    assert load_config(args + ["--lora-train-only"], entry)[0].train.lora_train_only


def test_lora_over_broadcast_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="disk-delta") as info:
        load_config(["--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", *LORA], "train_async")
    assert "--update-weight-transfer-mode" in info.value.flags


def test_adapter_versions_on_an_object_store_and_attached_engines(tmp_path: Path) -> None:
    """An s3:// store keeps the adapter chain's version 0 in the run directory (a local path); attached
    engines serve the adapter versions too (vetted for it), and so does the trainer publish them."""
    from miles_disagg.config.actors import EngineManagerConfig, TrainerGroupConfig
    from miles_disagg.config.lora_rules import serves_adapters

    s3 = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "s3://bucket/run",
          "--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", "--rollout-backend", "builtin",
          "--run-dir", str(tmp_path / "out"), *LORA]
    config = load_config(s3, "train_async")[0]
    assert serves_adapters(config)
    assert EngineManagerConfig.from_run(config).lora_base_dir == str(tmp_path / "out") + "/lora-v0"
    attached = load_config(DISK_DELTA + ["--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", *LORA,
                                         "--rollout-external", "--rollout-external-engine-addrs", "127.0.0.1:9"],
                           "train_async")[0]
    assert serves_adapters(attached) and TrainerGroupConfig.from_run(attached).lora_base_dir == "/tmp/d.lora-v0"
    service = load_config(DISK_DELTA + ["--hf-checkpoint", str(tmp_path), "--train-backend", "fsdp", *LORA,
                                        "--rollout-service-url", "http://127.0.0.1:9"], "train_async")[0]
    assert serves_adapters(service) and EngineManagerConfig.from_run(service).lora_base_dir == "/tmp/d.lora-v0"
    with pytest.raises(ConfigError) as on_s3:  # the chain's version 0 in the store: no service replica reads it
        load_config(s3 + ["--rollout-service-url", "http://127.0.0.1:9"], "train_async")
    assert "object store" in str(on_s3.value) and "--rollout-service-url" in on_s3.value.flags
