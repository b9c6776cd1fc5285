"""A LoRA run on an object store: the adapter chain's version 0 lives in the store (``lora_base`` in
``LATEST``), managed engines are told to fetch it (``--lora-base-from-store``), ``--rollout-base-from-store``
is taken with ``--lora-rank``, and an attached engine is vetted for it; a directory store is unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_disagg.config.loader import load_config
from miles_disagg.types import FormatError, VersionRef

LORA = ["--train-backend", "fsdp", "--lora-rank", "8", "--update-weight-transfer-mode", "disk-delta",
        "--rollout-backend", "builtin"]


def manager(tmp_path: Path, store: str, *extra: str):
    from miles_disagg.config.actors import EngineManagerConfig

    (tmp_path / "config.json").write_text("{}")
    config = load_config(["--hf-checkpoint", str(tmp_path), "--update-weight-disk-dir", store, "--run-dir",
                          str(tmp_path / "out"), *LORA, *extra], "train_async")[0]
    return EngineManagerConfig.from_run(config)


def test_an_object_store_run_tells_its_engines_to_fetch_both_bases_from_it(tmp_path: Path) -> None:
    from miles_disagg.fleet.plan import engine_specs

    config = manager(tmp_path, "s3://bucket/run", "--rollout-base-from-store")  # refused before this change
    assert config.lora_base_from_store and config.lora_base_dir == str(tmp_path / "out" / "lora-v0")
    builtin, sglang = engine_specs(config, [[0]], "builtin")[0], engine_specs(config, [[0]], "sglang")[0]
    assert builtin.base_from_store and builtin.model_path.name == "engine-0.base"
    assert "--lora-base-from-store" in builtin.extra_args and "--lora-base-dir" not in builtin.extra_args
    assert "--lora-base-from-store" in sglang.agent_args and "--lora-base-dir" not in sglang.agent_args


def test_a_directory_store_keeps_the_adapter_base_beside_it(tmp_path: Path) -> None:
    from miles_disagg.fleet.plan import engine_specs

    config = manager(tmp_path, str(tmp_path / "store"))
    assert not config.lora_base_from_store and config.lora_base_dir == str(tmp_path / "store") + ".lora-v0"
    args = engine_specs(config, [[0]], "builtin")[0].extra_args
    assert args[args.index("--lora-base-dir") + 1] == config.lora_base_dir and "--lora-base-from-store" not in args


def test_an_attached_engine_must_fetch_the_adapter_base_from_the_store(tmp_path: Path) -> None:
    from miles_disagg.fleet.vetting import lora_problems

    config = manager(tmp_path, "s3://bucket/run")
    assert lora_problems(config, {"enable_lora": True, "lora_base_dir": "/n/ckpt.lora-v0",
                                  "lora_base_from_store": True}, None) == []
    local = lora_problems(config, {"enable_lora": True, "lora_base_dir": config.lora_base_dir}, None)
    assert len(local) == 1 and "--lora-base-from-store" in local[0] and "s3://bucket/run" in local[0]
    agent = lora_problems(config, {"enable_lora": True}, {"lora_base_dir": "/x", "lora_base_from_store": False})
    assert len(agent) == 1 and "start the agent with --lora-base-from-store" in agent[0]


def test_the_pointer_carries_the_adapter_base_and_refuses_one_outside_its_folder() -> None:
    from miles_disagg.weights.object_layout import Pointer, StoredObject, parse_pointer

    adapter = StoredObject(f"lora-base/{'a' * 12}/manifest.json", 10, "0" * 32)
    pointer = Pointer(VersionRef("r", 0), {}, adapter_base=adapter)  # a store holding only the adapter base
    read = parse_pointer(pointer.to_json(), "etag-1", "LATEST")
    assert read.adapter_base == adapter and read.base is None and read.at_etag("e2").adapter_base == adapter
    assert read.keeping(set()).adapter_base == adapter
    hostile = pointer.to_json()
    hostile["lora_base"]["manifest"] = f"base/{'a' * 12}/manifest.json"
    with pytest.raises(FormatError, match="lora-base"):
        parse_pointer(hostile, "e", "LATEST")


def test_engine_flags_of_the_adapter_base_from_the_store(tmp_path: Path) -> None:
    from miles_disagg.engines.builtin.config import EngineConfig

    local = tmp_path / "ckpt"
    config = EngineConfig(model_path=tmp_path, enable_lora=True, lora_base_from_store=True,
                          weight_store_dirs=["s3://bucket/run"], local_checkpoint_dir=local)
    assert config.lora_base_dir == tmp_path / "ckpt.lora-v0"
    with pytest.raises(ValueError, match="object store"):
        EngineConfig(model_path=tmp_path, enable_lora=True, lora_base_from_store=True,
                     weight_store_dirs=[str(tmp_path)], local_checkpoint_dir=local)
    with pytest.raises(ValueError, match="--local-checkpoint-dir"):
        EngineConfig(model_path=tmp_path, enable_lora=True, lora_base_from_store=True,
                     weight_store_dirs=["s3://bucket/run"])
