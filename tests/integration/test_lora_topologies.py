"""LoRA adapter versions beyond built-in engines the job launches on a directory store: an object
store (``s3://``, moto) holding the model's base and the adapter chain's version 0, feeding an
attached built-in engine and an agent that have only its URL (each fetches both onto its own node),
vetted for adapter serving before any key is sent, updated by the run's own disk-delta updater
with no pause; an attached engine that would
serve the bare base (started without ``--enable-lora``, or on another adapter chain, or an agent)
is refused with one line before step 1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from engine_fixtures import inprocess_engine
from lora_fixtures import publish_adapter_chain
from s3_fixtures import s3_env, s3_server  # noqa: F401 - fixtures

from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(300)


def run_config(model: Path, store: str, run_dir: Path, addr: str, *extra: str):
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.config.loader import load_config

    config = load_config(["--hf-checkpoint", str(model), "--train-backend", "fsdp", "--lora-rank", "4",
                          "--lora-alpha", "8", "--update-weight-transfer-mode", "disk-delta",
                          "--update-weight-disk-dir", store, "--run-dir", str(run_dir), "--rollout-external",
                          "--rollout-external-engine-addrs", addr, *extra], "train_async")[0]
    return EngineManagerConfig.from_run(config)


def s3(server):
    import boto3

    return boto3.client("s3", endpoint_url=server.url, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def weights_cli(*args: str):
    import os
    import subprocess
    import sys

    from deadlines import scaled

    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", *args], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=scaled(120))


def _corrupt_adapter_v0(server, bucket: str, store: str) -> tuple[str, bytes]:
    """Flip one byte of the store's adapter v0 tensors object; returns its key and its true bytes."""
    client = s3(server)
    prefix = store.removeprefix(f"s3://{bucket}/")
    pointer = json.loads(client.get_object(Bucket=bucket, Key=f"{prefix}/LATEST")["Body"].read())
    key = f"{prefix}/{pointer['lora_base']['manifest'].rsplit('/', 1)[0]}/adapter_model.safetensors"
    good = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(bad))
    return key, good


@pytest.fixture(scope="module")
def s3_chain(tiny_qwen3_dir, s3_server, tmp_path_factory):  # noqa: F811 - fixtures
    """A LoRA run's publication on an object store (moto), the model's base and the adapter chain's
    version 0 in it, v1 and v2 after; the trainer's own directory removed (no engine may read it)."""
    import shutil
    import uuid

    root = tmp_path_factory.mktemp("lora-s3")
    bucket = s3_server.create_bucket(f"test-{uuid.uuid4().hex[:16]}")
    store, run_dir = f"s3://{bucket}/lora-run", root / "trainer" / "run"
    with pytest.MonkeyPatch.context() as env:
        for name, value in s3_server.env().items():
            env.setenv(name, value)
        published = publish_adapter_chain(tiny_qwen3_dir, store, run_dir / "lora-v0", versions=2, base_in_store=True)
    shutil.rmtree(root / "trainer")  # the trainer's node: nothing of it is readable by an engine
    return {"server": s3_server, "bucket": bucket, "store": store, "run_dir": run_dir, "published": published}


def node_with_the_model_from(store: str, node: Path) -> Path:
    """An engine node's own copy of the model's base, fetched from the store (``weights fetch-base``'s pull)."""
    from miles_disagg.weights.object_base import pull_base
    from miles_disagg.weights.stores import open_store

    node.mkdir(parents=True)
    return pull_base(open_store(store, cache_dir=node / ".mirror"), node / "model")


def test_an_engine_with_only_the_store_url_fetches_adapter_v0_and_versions_from_it_without_a_pause(
        tiny_qwen3_dir, s3_chain, s3_env, tmp_path) -> None:  # noqa: F811 - fixtures
    """No shared path, the engine on a root of its own: a corrupted v0 object is refused (4xx, nothing
    loaded, nothing fetched), then the engine reaches v1 and v2 from the store alone with no pause,
    holding the publisher's checksums."""
    from miles_disagg.engines.updater import DiskDeltaUpdater
    from miles_disagg.fleet.attach import attached_engines
    from miles_disagg.fleet.vetting import vet

    store, local = s3_chain["store"], tmp_path / "engine-node" / "ckpt"
    model = node_with_the_model_from(store, local.parent)
    with inprocess_engine(model, enable_lora=True, lora_base_from_store=True, weight_store_dirs=[store],
                          local_checkpoint_dir=local) as (_engine, handle):
        config = run_config(tiny_qwen3_dir, store, s3_chain["run_dir"], handle.url.removeprefix("http://"),
                            "--rollout-base-from-store")  # the engines get the model and the adapter base from the store
        assert config.lora_base_from_store and config.lora_base_dir == str(s3_chain["run_dir"] / "lora-v0")
        assert vet(config, handle.url, answer_timeout_s=30).refusal is None
        assert len(attached_engines(config)) == 1
        key, good = _corrupt_adapter_v0(s3_chain["server"], s3_chain["bucket"], store)
        by_hand = tmp_path / "by-hand" / "lora-v0"  # `weights fetch-base --lora`: an adapter v0 fetched by hand
        try:
            refused = handle.post("/pull_weights", {"target_version": 0, "source_dir": store})
            cli_refused = weights_cli("fetch-base", "--lora", "--store", store, "--dest", str(by_hand))
        finally:
            s3(s3_chain["server"]).put_object(Bucket=s3_chain["bucket"], Key=key, Body=good)
        assert 400 <= refused.status_code < 500 and "checksum" in refused.text, refused.text
        assert cli_refused.returncode == 2 and "checksum" in cli_refused.stderr and not by_hand.exists()
        assert len(cli_refused.stderr.strip().splitlines()) <= 2 and "Traceback" not in cli_refused.stderr
        fetched = weights_cli("fetch-base", "--lora", "--store", store, "--dest", str(by_hand))
        assert fetched.returncode == 0, fetched.stderr
        assert json.loads(fetched.stdout)["files"] == ["adapter_config.json", "adapter_model.safetensors"]
        assert handle.get("/server_info").json()["loaded_lora_adapters"] == []
        assert not local.with_name("ckpt.lora-v0").exists()
        updater = DiskDeltaUpdater([handle.url], store_dir=store, local_dirs=[str(local)])
        try:
            reports = [updater.update(version) for version in (0, 1, 2)]  # v0 first: never the bare base
        finally:
            updater.close()
        assert [r.pause_time_s for r in reports] == [0.0, 0.0, 0.0]  # activation beside the served adapter
        assert handle.version() == "2"
        info = handle.get("/server_info").json()
        assert info["lora_base_from_store"] is True and info["lora_base_dir"] == str(local.with_name("ckpt.lora-v0"))
        assert (local.with_name("ckpt.lora-v0") / "adapter_config.json").is_file()  # fetched onto its own node
        assert "v2" in [a["lora_name"] for a in info["loaded_lora_adapters"]]
        sums = handle.get("/weight_checksums", params={"algorithm": "xxh3-128"}).json()
        assert (sums["source"], sums["checksums"]) == ("lora", s3_chain["published"])
        answer = handle.generate({"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}})
        assert answer["meta_info"]["weight_version_start"] == "2"  # a request naming no adapter: the served one


def test_the_agent_with_only_the_store_url_serves_adapter_versions_and_labels_streamed_events(
        s3_chain, s3_env, tmp_path) -> None:  # noqa: F811 - fixtures
    """``agent --lora-base-from-store`` in front of an engine standing in for stock SGLang: v0 fetched
    onto its node, v1 and v2 from the store with no pause; a streamed ``/generate`` pinned to the
    older resident v1 has every SSE event labelled v1 (the engine's own label is 2)."""
    import httpx
    from deadlines import scaled
    from engine_fixtures import sse_events

    from miles_disagg.engines.launch import launch_agent
    from miles_disagg.engines.updater import DiskDeltaUpdater

    store, node = s3_chain["store"], tmp_path / "agent-node"
    local, model = node / "ckpt", node_with_the_model_from(store, node)
    with inprocess_engine(model, enable_lora=True, allow_unverified_versions=True, lora_roots=[str(node)]) as (_e, engine):
        agent = launch_agent(engine.url, local, log_path=node / "agent.log", store_dirs=[store],
                             extra_args=["--lora-base-from-store"])
        client = httpx.Client(base_url=agent.url, timeout=scaled(60))
        try:
            updater = DiskDeltaUpdater([agent.url], store_dir=store, local_dirs=[str(local)])
            try:
                reports = [updater.update(version) for version in (0, 1, 2)]
            finally:
                updater.close()
            info = client.get("/agent_info").json()
            streamed = client.post("/generate", json={"input_ids": [5, 6, 7], "lora_path": "v1", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 3}})
        finally:
            client.close()
            agent.stop()
    assert [r.pause_time_s for r in reports] == [0.0, 0.0, 0.0]
    assert info["lora_base_from_store"] is True and info["resident_weight_versions"] == {"1": "v1", "2": "v2"}
    assert (node / "ckpt.lora-v0" / "adapter_config.json").is_file()
    events = [e for e in sse_events(streamed) if e != "[DONE]"]
    assert streamed.status_code == 200 and events, streamed.text
    assert all((e["meta_info"]["weight_version_start"], e["meta_info"]["weight_version_end"]) == ("1", "1")
               for e in events), events


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
