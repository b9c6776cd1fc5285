"""LoRA against SGLang's own code: the launcher's LoRA server args parsed by SGLang's ``ServerArgs``,
and the adapter calls and ``lora_path`` on ``/generate`` as the project sends them, parsed by
SGLang's HTTP app into its ``io_struct`` request types."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_server_args import BASE, ArgvRefused, parse

from miles_disagg.config.lora_rules import resolve_targets
from miles_disagg.config.sglang_args import parse_sglang_passthrough
from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.sglang import LoraServing, sglang_command
from miles_disagg.types import ConfigError


def test_lora_server_args_parse_as_sglang_reads_them(sglang_loaded):
    lora = LoraServing(max_lora_rank=8, target_modules=resolve_targets("all-linear", None), max_loaded_loras=3,
                       max_loras_per_batch=2)
    args = parse(sglang_command("/models/qwen", **BASE, lora=lora))
    assert args.enable_lora is True
    assert (args.max_lora_rank, args.max_loaded_loras, args.max_loras_per_batch) == (8, 3, 2)
    assert set(args.lora_target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}
    with pytest.raises(ConfigError, match="--sglang-max-lora-rank"):
        sglang_command("/models/qwen", **BASE, lora=lora,
                       extra_args=parse_sglang_passthrough(["--sglang-max-lora-rank", "16"]))
    with pytest.raises(ArgvRefused):  # the parser of this tier is strict: a flag SGLang lacks is an error
        parse(sglang_command("/models/qwen", **BASE) + ["--lora-rank", "8"])


def test_adapter_calls_and_lora_path_reach_sglang_as_its_request_types(sglang, manager, io_struct):
    from miles_disagg.rollout.generate import SamplingSettings, request_body

    with EngineClient(sglang.url) as client:
        loaded = client.load_lora_adapter("v3", "/ckpt/lora/v3", pinned=True)
        client.unload_lora_adapter("v2")
        client.generate(request_body([3, 4, 5], SamplingSettings(max_new_tokens=2), min_version=None,
                                     num_samples=2, lora_path="v3"))
    assert loaded["success"] is True and loaded["loaded_adapters"] == {"v3": "/ckpt/lora/v3"}
    (load,) = manager.of_type("LoadLoRAAdapterReqInput")
    assert (load.lora_name, load.lora_path, load.pinned) == ("v3", "/ckpt/lora/v3", True)
    (unload,) = manager.of_type("UnloadLoRAAdapterReqInput")
    assert unload.lora_name == "v2"
    (req,) = manager.of_type("GenerateReqInput")
    assert req.lora_path == ["v3", "v3"]  # SGLang normalized it: one per prompt


def test_the_agent_forwards_adapter_loads_under_its_lora_roots_only(sglang, manager, io_struct, tiny_qwen3_dir,
                                                                    tmp_path):
    from miles_disagg.engines.launch import launch_agent

    root, elsewhere = tmp_path / "adapters", tmp_path / "elsewhere"
    (root / "v1").mkdir(parents=True)
    elsewhere.mkdir()
    (tmp_path / "host").mkdir()
    agent = launch_agent(sglang.url, tmp_path / "host" / "ckpt", log_path=tmp_path / "agent.log",
                         base_dir=tiny_qwen3_dir, extra_args=["--lora-root", str(root)])
    try:
        with EngineClient(agent.url) as client:
            client.load_lora_adapter("v1", str(root / "v1"))
            refused = client.request("POST", "/load_lora_adapter",
                                     json={"lora_name": "x", "lora_path": str(root / ".." / "elsewhere")})
            client.generate({"input_ids": [1, 2], "lora_path": "v1", "sampling_params": {"max_new_tokens": 1}})
    finally:
        agent.stop()
    assert refused.status_code == 403 and "--lora-root" in refused.text
    (load,) = manager.of_type("LoadLoRAAdapterReqInput")  # the refused one never reached SGLang
    assert (load.lora_name, load.lora_path) == ("v1", str(root / "v1"))
    (req,) = manager.of_type("GenerateReqInput")
    assert req.lora_path == "v1"


def test_the_agent_serves_a_runs_adapter_versions_on_sglang_without_a_pause(sglang, manager, io_struct,
                                                                           tiny_qwen3_dir, tmp_path):
    """``--lora-base-dir``: the run's updater brings the agent to adapter versions 0, 1, 2 from the store;
    SGLang gets each by /load_lora_adapter from the host-local copy and its label by /update_weight_version
    without aborting anything, never a pause; the oldest beyond two leaves by /unload_lora_adapter. Through
    the run's router, a rollout request (min_version) reaches SGLang with the served version's lora_path and
    an exact_version request of the older resident one with its own, each attributed to its version."""
    import time

    import httpx
    from lora_fixtures import publish_adapter_chain

    from miles_disagg.engines.launch import launch_agent
    from miles_disagg.engines.updater import DiskDeltaUpdater
    from miles_disagg.rollout.generate import SamplingSettings, request_body
    from miles_disagg.router.launch import launch_router
    from miles_disagg.weights.adapters import check_adapter_dir
    from miles_disagg.weights.checksums import checksum
    from miles_disagg.weights.safetensors_io import checkpoint_tensors, read_bytes

    store, base, local = tmp_path / "store", tmp_path / "store.lora-v0", tmp_path / "host" / "ckpt"
    published = publish_adapter_chain(tiny_qwen3_dir, str(store), base, versions=2)
    local.parent.mkdir()
    agent = launch_agent(sglang.url, local, log_path=tmp_path / "agent.log", base_dir=tiny_qwen3_dir,
                         store_dirs=[str(store)], extra_args=["--lora-base-dir", str(base),
                                                              "--lora-resident-versions", "2"])
    try:
        with EngineClient(agent.url) as client:  # before any adapter version: refused, never the bare base
            early = client.request("POST", "/generate", json={"input_ids": [1, 2]})
            as_model = client.request("POST", "/update_weights_from_disk", json={"model_path": str(base)})
        assert early.status_code == 400 and "bare base" in early.text and not manager.of_type("GenerateReqInput")
        assert as_model.status_code == 400 and "never as the model's weights" in as_model.text
        updater = DiskDeltaUpdater([agent.url], store_dir=str(store), local_dirs=[str(local)])
        try:
            pauses = [updater.update(version).pause_time_s for version in (0, 1, 2)]
        finally:
            updater.close()
        with EngineClient(agent.url) as client:
            deadline = time.monotonic() + 60
            while not manager.of_type("UnloadLoRAAdapterReqInput") and time.monotonic() < deadline:
                time.sleep(0.05)
            info = client.request("GET", "/model_info").json()
            sums = client.request("GET", "/weight_checksums?algorithm=xxh3-128").json()  # --check-weight-update-equal
        router = launch_router(log_path=tmp_path / "router.log", workers=[agent.url], health_check_interval_s=0.2)
        try:
            with router.client() as client:
                while not [w for w in client.list_workers() if w["state"] == "ready" and w["weight_version"] == 2]:
                    assert time.monotonic() < deadline, client.list_workers()
                    time.sleep(0.05)
            settings = SamplingSettings(max_new_tokens=1)
            newest, pinned = (httpx.post(f"{router.url}/generate", json=request_body([9, 8], settings, **constraint),
                                         timeout=30) for constraint in ({"min_version": 2}, {"min_version": None,
                                                                                             "exact_version": 1}))
            assert newest.status_code == 200 and pinned.status_code == 200, (newest.text, pinned.text)
        finally:
            router.stop()
    finally:
        agent.stop()
    assert pauses == [0.0, 0.0, 0.0] and not manager.of_type("PauseGenerationReqInput")
    loads = manager.of_type("LoadLoRAAdapterReqInput")
    assert [load.lora_name for load in loads] == ["v0", "v1", "v2"]
    served = Path(loads[-1].lora_path)
    assert served.parent == local.parent / "ckpt.adapters" and check_adapter_dir(served).rank == 4
    assert {n: checksum("xxh3-128", read_bytes(served / f, e)) for n, (f, e) in checkpoint_tensors(served).items()} \
        == published  # the host-local copy SGLang loaded is the trainer's adapter version 2
    labels = manager.of_type("UpdateWeightVersionReqInput")
    assert [(r.new_version, r.abort_all_requests) for r in labels] == [("0", False), ("1", False), ("2", False)]
    assert [r.lora_name for r in manager.of_type("UnloadLoRAAdapterReqInput")] == ["v0"]
    rollouts = [r for r in manager.of_type("GenerateReqInput") if r.input_ids == [9, 8]]  # not SGLang's /health
    assert [r.lora_path for r in rollouts] == ["v2", "v1"]  # never the bare base by omission
    for answer, version in ((newest, 2), (pinned, 1)):
        meta = answer.json()["meta_info"]
        assert (meta["weight_version_start"], meta["weight_version_end"]) == (version, version), meta
    assert info["resident_weight_versions"] == {"1": "v1", "2": "v2"} and info["weight_version"] == "2"
    assert (sums["weight_version"], sums["checksums"]) == ("2", published)


def test_a_run_vets_the_agents_sglang_for_lora_and_launches_sglang_with_its_lora_args(sglang, manager,
                                                                                     tiny_qwen3_dir, tmp_path):
    """An agent whose SGLang was started without --enable-lora is refused (it would serve the bare base;
    the agent's own chain matches, so that is the one LoRA problem); launched SGLang engines of a LoRA run start with the LoRA server args SGLang's ServerArgs
    reads and the agent with the run's --lora-base-dir."""
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.config.loader import load_config
    from miles_disagg.engines.launch import engine_processes, launch_agent
    from miles_disagg.fleet.plan import engine_specs
    from miles_disagg.fleet.vetting import vet

    store, local = tmp_path / "store", tmp_path / "host" / "ckpt"
    store.mkdir()
    local.parent.mkdir()
    config = EngineManagerConfig.from_run(load_config([
        "--hf-checkpoint", str(tiny_qwen3_dir), "--train-backend", "fsdp", "--lora-rank", "8",
        "--target-modules", "attn", "--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir",
        str(store), "--run-dir", str(tmp_path / "run"), "--rollout-backend", "sglang"], "train_async")[0])
    base = f"{store}.lora-v0"
    agent = launch_agent(sglang.url, local, log_path=tmp_path / "agent.log", base_dir=tiny_qwen3_dir,
                         store_dirs=[str(store)], extra_args=["--lora-base-dir", base])
    try:
        vetting = vet(config, agent.url, answer_timeout_s=30)  # SGLang's own /server_info, through the agent
    finally:
        agent.stop()
    assert vetting.info["agent_info"]["lora_base_dir"] == base  # the agent serves this run's chain ...
    (problem,) = [p for p in vetting.problems if p.startswith("LoRA")]  # ... but SGLang would run on the bare base
    assert "without --enable-lora" in problem and "bare base" in problem and "--lora-base-dir" in problem
    (spec,) = engine_specs(config, [[0]], "sglang")
    server, agent_plan = engine_processes(spec, port=30001)
    args = parse(server.argv)
    assert (args.enable_lora, args.max_lora_rank, set(args.lora_target_modules)) == (
        True, 8, {"q_proj", "k_proj", "v_proj", "o_proj"})
    assert args.max_loaded_loras == args.max_loras_per_batch == 3
    assert agent_plan.argv[agent_plan.argv.index("--lora-base-dir") + 1] == base
