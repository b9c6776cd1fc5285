"""MoE engines judged by SGLang 0.5.23's own code: the launch argv of an expert-parallel engine with
routing replay (``--ep-size``, ``--enable-dp-attention``/``--dp-size``, ``--enable-return-routed-
experts``) parsed by its ``ServerArgs``, and the rollout's ``return_routed_experts`` bodies (a
batched group; a two-turn sample's second call with ``routed_experts_start_len``) parsed by its
HTTP app into its ``GenerateReqInput``; the routing it answers (encoded as its tokenizer manager
encodes it) decoded by our rollout as by SGLang's own helper."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

from test_server_args import parse

pytestmark = pytest.mark.timeout(300)

LAYERS, TOP_K = 2, 2
MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 48,
       "num_experts": 128, "num_experts_per_tok": 8}


def test_an_expert_parallel_engine_with_routing_replay_parses(sglang_loaded, tmp_path):
    """A miles line's SGLang options for Qwen3-30B-A3B-like engines (8 GPUs, EP 8, DP attention),
    through the job's config and the manager's engine specs, into SGLang's ServerArgs."""
    from miles_disagg.config import load_config
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.engines.launch import engine_processes
    from miles_disagg.fleet.plan import engine_specs

    model = tmp_path / "qwen3-30b-a3b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MOE))
    config, _ = load_config(["--hf-checkpoint", str(model), "--rollout-num-gpus-per-engine", "8",
                             "--use-rollout-routing-replay", "--sglang-ep-size", "8", "--sglang-enable-dp-attention",
                             "--sglang-dp-size", "8", "--sglang-enable-dp-lm-head",
                             "--sglang-mem-fraction-static", "0.7"], "train_async")
    specs = engine_specs(EngineManagerConfig.from_run(config), [list(range(8)), list(range(8, 16))], "sglang")
    for index, spec in enumerate(specs):
        argv = engine_processes(spec, port=30000 + index)[0].argv
        args = parse(argv)
        assert (args.tp_size, args.ep_size, args.dp_size) == (8, 8, 8)
        assert args.enable_dp_attention is True and args.enable_dp_lm_head is True
        assert args.enable_return_routed_experts is True
        assert args.model_path == str(model) and args.mem_fraction_static == 0.7


def test_without_replay_sglang_engines_do_not_capture_routing(sglang_loaded, tmp_path):
    from miles_disagg.config import load_config
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.engines.launch import engine_processes
    from miles_disagg.fleet.plan import engine_specs

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MOE))
    config, _ = load_config(["--hf-checkpoint", str(model), "--rollout-num-gpus-per-engine", "2",
                             "--sglang-ep-size", "2"], "train_async")
    (spec,) = engine_specs(EngineManagerConfig.from_run(config), [[0, 1]], "sglang")
    args = parse(engine_processes(spec, port=30000)[0].argv)
    assert args.ep_size == 2 and args.enable_return_routed_experts is False


class RouterInFront(httpx.AsyncBaseTransport):
    """What our router does to a /generate on its way to SGLang's app: takes the version
    constraint off the body, and adds the served versions to each answer's meta_info."""

    def __init__(self, url: str):
        self.url = url

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        from miles_disagg.router.policy import request_constraint

        body = json.loads(request.content)
        request_constraint(body, {})
        async with httpx.AsyncClient(timeout=60, trust_env=False) as client:
            answer = (await client.post(f"{self.url}/generate", json=body)).json()
        for item in answer if isinstance(answer, list) else [answer]:
            version = int(item["meta_info"]["weight_version"])
            item["meta_info"].update(weight_version_start=version, weight_version_end=version)
        return httpx.Response(200, json=answer)


async def two_turns(args, sample, sampling_params):
    """Turn 1, a tool answer, turn 2 (the hook the two-turn test runs)."""
    params = {**sampling_params, "max_new_tokens": 2}
    sample = await args.engine.generate(sample, params)
    args.engine.append_tool_output(sample, "99")
    return await args.engine.generate(sample, params)


def _rollout(tiny_qwen3_dir: Path, url: str, **rollout):
    from miles_disagg.config.actors import RolloutManagerConfig
    from miles_disagg.config.components import RolloutConfig
    from miles_disagg.rollout.manager import RolloutManager

    config = RolloutConfig(**{"rollout_batch_size": 1, "n_samples_per_prompt": 2, "rollout_max_response_len": 6,
                              "max_weight_staleness": 4, **rollout})
    manager = RolloutManager(RolloutManagerConfig(rollout=config, router_url="http://router", hf_dir=str(tiny_qwen3_dir),
                                                  routed_experts=(LAYERS, TOP_K)),
                             http_transport=RouterInFront(url))

    async def scenario():
        try:
            return await manager.generate(1, 0)
        finally:
            await manager.stop()
    return asyncio.run(scenario())


def _expected_row(position: int) -> np.ndarray:
    return np.array([[position * 100 + layer * 10 + k for k in range(TOP_K)] for layer in range(LAYERS)], np.int32)


@pytest.fixture
def routing_manager(manager):
    manager.routing = (LAYERS, TOP_K)
    yield manager
    manager.routing = None


def test_a_batched_routing_request_parses_and_its_answer_decodes(sglang, routing_manager, io_struct, tiny_qwen3_dir):
    from sglang.srt.state_capturer.routed_experts import extract_routed_experts_from_meta_info

    batch = _rollout(tiny_qwen3_dir, sglang.url)
    (req,) = routing_manager.of_type("GenerateReqInput")
    assert isinstance(req, io_struct.GenerateReqInput) and len(req.input_ids) == 2
    assert req.return_routed_experts is True and req.routed_experts_start_len == 0
    for sample in (s for g in batch.groups for s in g.samples):
        rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert sample.rollout_routed_experts.shape == (rows, LAYERS, TOP_K)
        assert all(np.array_equal(sample.rollout_routed_experts[p], _expected_row(p)) for p in range(rows))
    # SGLang's own decoding of the same payload agrees with ours
    encoded = routing_manager._routed_experts(5, 0)
    flat = extract_routed_experts_from_meta_info({"meta_info": {"routed_experts": encoded}})
    assert np.array_equal(flat.reshape(4, LAYERS, TOP_K), np.stack([_expected_row(p) for p in range(4)]))


def test_a_second_turn_asks_only_for_positions_no_earlier_call_ran(sglang, routing_manager, io_struct,
                                                                   tiny_qwen3_dir):
    batch = _rollout(tiny_qwen3_dir, sglang.url, custom_generate_function_path="test_sglang_moe.two_turns")
    requests = routing_manager.of_type("GenerateReqInput")
    assert len(requests) == 4 and all(r.return_routed_experts is True for r in requests)
    second = [r for r in requests if r.routed_experts_start_len > 0]
    assert len(second) == 2
    for req in second:  # within SGLang's bound [0, prompt tokens]: turn 1's last token and the tool's
        assert req.routed_experts_start_len == len(req.input_ids) - 3
    for sample in (s for g in batch.groups for s in g.samples):
        rows = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert sample.rollout_routed_experts.shape == (rows, LAYERS, TOP_K)
        assert all(np.array_equal(sample.rollout_routed_experts[p], _expected_row(p)) for p in range(rows))


QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B's config.json (config-only checkpoint)
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}
SCRIPT_30B = Path(__file__).resolve().parents[2] / "scripts" / "run_qwen3_30B_A3B_disk_delta.sh"


def _script_line(script: Path, tmp_path: Path) -> list[str]:
    """The train_async.py arguments the script execs: its required MILES_DISAGG_* variables filled in
    (a config-only checkpoint, a prompts file, a work dir) and PYTHON a shim that records its argv."""
    import os
    import re
    import subprocess
    import sys

    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": [{"role": "user", "content": "1+1?"}], "label": "2"}\n')
    env = {**os.environ}
    for name in set(re.findall(r"\$\{(MILES_DISAGG_\w+)", script.read_text())):
        env[name] = str(prompts if "JSONL" in name else tmp_path / "work" if "WORK" in name else model)
    record = tmp_path / "argv.json"
    shim = tmp_path / "python-shim"
    shim.write_text(f"#!{sys.executable}\nimport json, sys\njson.dump(sys.argv[1:], open({str(record)!r}, 'w'))\n")
    shim.chmod(0o755)
    done = subprocess.run(["bash", str(script)], env={**env, "PYTHON": str(shim)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    argv = json.loads(record.read_text())
    assert argv[0].endswith("train_async.py"), argv[:2]
    return argv[1:]


def test_the_30b_a3b_scripts_engines_parse(sglang_loaded, tmp_path, monkeypatch):
    """scripts/run_qwen3_30B_A3B_disk_delta.sh (the MoE launch line): each SGLang EP engine's command as
    the manager builds it, parsed by SGLang's ServerArgs."""
    if not SCRIPT_30B.is_file():
        pytest.skip(f"{SCRIPT_30B.name} is not in this tree yet (the Megatron MoE work adds it)")
    from miles_disagg.config import load_config
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.engines.launch import engine_processes
    from miles_disagg.fleet.plan import engine_specs

    monkeypatch.chdir(tmp_path)
    config, _ = load_config(_script_line(SCRIPT_30B, tmp_path), "train_async")
    tp = config.cluster.rollout_num_gpus_per_engine
    engines = [list(range(i * tp, (i + 1) * tp)) for i in range(config.cluster.rollout_num_gpus // tp)]
    assert engines, "the script launches no engine"
    for index, spec in enumerate(engine_specs(EngineManagerConfig.from_run(config), engines, "sglang")):
        args = parse(engine_processes(spec, port=30000 + index)[0].argv)
        assert args.tp_size == tp and args.ep_size == int(config.sglang_args.get("ep-size", 1))
        assert args.enable_return_routed_experts is config.train.use_rollout_routing_replay
