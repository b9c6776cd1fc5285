"""LoRA adapter versions beyond built-in engines the job launches on a directory store: an object
store (``s3://``, moto) feeding an attached built-in engine, vetted for adapter serving before any key
is sent, updated by the run's own disk-delta updater with no pause; an attached engine that would
serve the bare base (started without ``--enable-lora``, or on another adapter chain, or an agent)
is refused with one line before step 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_fixtures import inprocess_engine
from lora_fixtures import publish_adapter_chain
from s3_fixtures import s3_bucket, s3_env, s3_server  # noqa: F401 - fixtures

from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(300)


def run_config(model: Path, store: str, run_dir: Path, addr: str):
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.config.loader import load_config

    config = load_config(["--hf-checkpoint", str(model), "--train-backend", "fsdp", "--lora-rank", "4",
                          "--lora-alpha", "8", "--update-weight-transfer-mode", "disk-delta",
                          "--update-weight-disk-dir", store, "--run-dir", str(run_dir), "--rollout-external",
                          "--rollout-external-engine-addrs", addr], "train_async")[0]
    return EngineManagerConfig.from_run(config)


def test_an_attached_engine_serves_adapter_versions_from_an_object_store_without_a_pause(
        tiny_qwen3_dir, s3_bucket, s3_env, tmp_path) -> None:  # noqa: F811 - fixtures
    from miles_disagg.engines.updater import DiskDeltaUpdater
    from miles_disagg.fleet.attach import attached_engines
    from miles_disagg.fleet.vetting import vet

    server, bucket = s3_bucket
    store, run_dir = f"s3://{bucket}/lora-run", tmp_path / "run"
    base_dir = run_dir / "lora-v0"  # where the run keeps an object store's adapter chain's version 0
    published = publish_adapter_chain(tiny_qwen3_dir, store, base_dir, versions=2)
    local = tmp_path / "host" / "ckpt"
    local.parent.mkdir()
    with inprocess_engine(tiny_qwen3_dir, enable_lora=True, lora_base_dir=base_dir, weight_store_dirs=[store],
                          local_checkpoint_dir=local) as (_engine, handle):
        config = run_config(tiny_qwen3_dir, store, run_dir, handle.url.removeprefix("http://"))
        assert config.lora_base_dir == str(base_dir)
        assert vet(config, handle.url, answer_timeout_s=30).refusal is None
        assert len(attached_engines(config)) == 1
        updater = DiskDeltaUpdater([handle.url], store_dir=store, local_dirs=[str(local)])
        try:
            reports = [updater.update(0)]  # the chain's version 0 first: a run never serves the bare base
            zero = handle.get("/server_info").json()["loaded_lora_adapters"]
            reports += [updater.update(version) for version in (1, 2)]
        finally:
            updater.close()
        assert [a["lora_name"] for a in zero] == ["v0"]
        assert [r.pause_time_s for r in reports] == [0.0, 0.0, 0.0]  # activation beside the served adapter
        assert handle.version() == "2"
        info = handle.get("/server_info").json()
        assert "v2" in [a["lora_name"] for a in info["loaded_lora_adapters"]] and info["lora_base_dir"] == str(base_dir)
        sums = handle.get("/weight_checksums", params={"algorithm": "xxh3-128"}).json()
        assert (sums["source"], sums["checksums"]) == ("lora", published)
        answer = handle.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert answer["meta_info"]["weight_version_start"] == "2"  # a request naming no adapter: the served one


def test_an_attached_engine_that_would_serve_the_bare_base_is_refused_in_one_line(tiny_qwen3_dir, tmp_path) -> None:
    from miles_disagg.fleet.attach import attached_engines

    store = tmp_path / "store"
    store.mkdir()
    with inprocess_engine(tiny_qwen3_dir, weight_store_dirs=[str(store)]) as (_engine, handle):
        config = run_config(tiny_qwen3_dir, str(store), tmp_path / "run", handle.url.removeprefix("http://"))
        with pytest.raises(ConfigError) as info:
            attached_engines(config)
    line = str(info.value)
    assert "\n" not in line and "without --enable-lora" in line and "bare base" in line
    assert f"--lora-base-dir {store}.lora-v0" in line and "--rollout-external-engine-addrs" in info.value.flags


def test_lora_problems_name_an_agent_and_another_adapter_chain(tmp_path) -> None:
    from miles_disagg.fleet.vetting import lora_problems

    config = run_config(tmp_path, str(tmp_path / "store"), tmp_path / "run", "127.0.0.1:9")
    ours = str(tmp_path / "store") + ".lora-v0"
    assert lora_problems(config, {"enable_lora": True, "lora_base_dir": ours}, None) == []
    other = lora_problems(config, {"enable_lora": True, "lora_base_dir": "/elsewhere"}, None)
    assert len(other) == 1 and "'/elsewhere'" in other[0] and ours in other[0]
    agent = lora_problems(config, {"enable_lora": True}, {"weight_store_dirs": []})
    assert len(agent) == 1 and f"start the agent with --lora-base-dir {ours}" in agent[0] and "None" in agent[0]
    assert lora_problems(config, {"enable_lora": True}, {"lora_base_dir": ours}) == []
    bare = lora_problems(config, {"enable_lora": False}, {"lora_base_dir": ours})
    assert len(bare) == 1 and "without --enable-lora" in bare[0] and "bare base" in bare[0]
