"""LoRA against SGLang's own code: the launcher's LoRA server args parsed by SGLang's ``ServerArgs``,
and the adapter calls and ``lora_path`` on ``/generate`` as the project sends them, parsed by
SGLang's HTTP app into its ``io_struct`` request types."""

from __future__ import annotations

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
