"""MoE routing replay, configuration: the flags need a MoE checkpoint (exit 2 on a dense one), one
rule decides when engines return routing and the rollout asks for it, managed engines get
``--enable-return-routed-experts``, and SGLang's MoE passthrough options are checked against an
engine's GPUs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.config import load_config
from miles_disagg.config.actors import EngineManagerConfig, RolloutManagerConfig
from miles_disagg.config.routing_replay import moe_routing_shape
from miles_disagg.config.sglang_args import check_parallel_passthrough, parse_sglang_passthrough
from miles_disagg.types import ConfigError

DENSE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 2}
MOE = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": 3,
       "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 1,
       "mlp_only_layers": [0], "norm_topk_prob": True}


def checkpoint(tmp_path: Path, config: dict, name: str = "model") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_routing_replay_on_a_dense_model_exits_2_with_one_line(tmp_path, capsys, flag):
    from miles_disagg.launcher import main

    dense = checkpoint(tmp_path, DENSE)
    assert main("train_async", ["--hf-checkpoint", str(dense), flag, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "dense" in err and str(dense) in err


@pytest.mark.parametrize("flag", ["--use-rollout-routing-replay", "--use-routing-replay"])
def test_routing_replay_on_a_moe_model_is_accepted(tmp_path, flag):
    config, _ = load_config(["--hf-checkpoint", str(checkpoint(tmp_path, MOE)), flag], "train_async")
    assert config.train.use_rollout_routing_replay == (flag == "--use-rollout-routing-replay")


def test_routing_replay_needs_a_checkpoint():
    with pytest.raises(ConfigError, match="give --hf-checkpoint"):
        load_config(["--use-rollout-routing-replay"], "train_async")


def test_moe_shape_from_config_json(tmp_path):
    assert moe_routing_shape(checkpoint(tmp_path, MOE, "moe")) == (3, 2)
    assert moe_routing_shape(checkpoint(tmp_path, DENSE, "dense")) is None
    assert moe_routing_shape(checkpoint(tmp_path, {**MOE, "num_experts": 0}, "zero")) is None
    # keys left out take transformers' Qwen3MoeConfig defaults (128 experts, top 8, 24 layers)
    assert moe_routing_shape(checkpoint(tmp_path, {"model_type": "qwen3_moe"}, "defaults")) == (24, 8)
    assert moe_routing_shape(tmp_path / "missing") is None


def test_moe_shape_of_a_checkpoint_transformers_saved(tmp_path):
    """The config.json transformers writes for Qwen3MoeForCausalLM (the contract's model family)."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=32, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                            num_experts=4, num_experts_per_tok=2)
    config.save_pretrained(tmp_path)
    assert moe_routing_shape(tmp_path) == (2, 2)


@pytest.mark.parametrize("replay, backend, routed", [
    (True, "sglang", (3, 2)), (True, "builtin", (3, 2)), (True, None, (3, 2)),
    (False, "builtin", (3, 2)),  # built-in engines always return routing for a MoE: train/routing_agreement
    (False, "sglang", None), (False, None, None),
])
def test_when_the_rollout_asks_for_routing(tmp_path, replay, backend, routed):
    argv = ["--hf-checkpoint", str(checkpoint(tmp_path, MOE))] + (["--use-rollout-routing-replay"] if replay else [])
    config, _ = load_config(argv, "train_async")
    assert RolloutManagerConfig.from_run(config, "http://router", backend=backend).routed_experts == routed


def test_a_dense_model_never_asks_for_routing(tmp_path):
    config, _ = load_config(["--hf-checkpoint", str(checkpoint(tmp_path, DENSE))], "train_async")
    assert RolloutManagerConfig.from_run(config, "http://router", backend="builtin").routed_experts is None
    assert not EngineManagerConfig.from_run(config).returns_routing("builtin")


@pytest.mark.parametrize("model, replay, backend, flagged", [
    (MOE, False, "builtin", True), (MOE, False, "sglang", False), (MOE, True, "sglang", True),
    (MOE, True, "builtin", True), (DENSE, False, "builtin", False), (DENSE, False, "sglang", False),
])
def test_managed_engines_start_with_the_routed_experts_flag(tmp_path, model, replay, backend, flagged):
    from miles_disagg.engines.launch import engine_processes
    from miles_disagg.fleet.plan import engine_specs

    argv = ["--hf-checkpoint", str(checkpoint(tmp_path, model)), "--rollout-num-gpus-per-engine", "1"]
    if replay:
        argv.append("--use-rollout-routing-replay")
    config, _ = load_config(argv, "train_async")
    (spec,) = engine_specs(EngineManagerConfig.from_run(config), [[0]], backend)
    argv = engine_processes(spec, port=30000)[0].argv
    assert ("--enable-return-routed-experts" in argv) == flagged


@pytest.mark.parametrize("passthrough, gpus, fragment", [
    (["--sglang-ep-size", "4"], 2, "--sglang-ep-size 4 must divide --rollout-num-gpus-per-engine 2"),
    (["--sglang-expert-parallel-size", "3"], 4, "--sglang-expert-parallel-size 3 must divide"),
    (["--sglang-ep-size", "0"], 2, "must be a positive integer"),
    (["--sglang-dp-size", "2"], 2, "needs --sglang-enable-dp-attention"),
    (["--sglang-dp-size", "4", "--sglang-enable-dp-attention"], 2, "--sglang-dp-size 4 must divide"),
    (["--sglang-enable-return-routed-experts"], 1, "set by --use-rollout-routing-replay"),
])
def test_sglang_moe_passthrough_is_checked(passthrough, gpus, fragment):
    with pytest.raises(ConfigError, match=fragment):
        check_parallel_passthrough(parse_sglang_passthrough(passthrough), gpus)


def test_two_names_of_one_sglang_option_are_refused_where_both_reach_the_check():
    """The command line keeps the last one given (``parse_sglang_passthrough``); options built otherwise are checked."""
    with pytest.raises(ConfigError, match="are one SGLang option"):
        check_parallel_passthrough({"ep-size": "2", "ep": "2"}, 2)
    check_parallel_passthrough(parse_sglang_passthrough(["--sglang-ep-size", "4", "--sglang-ep", "2"]), 2)


def test_sglang_moe_passthrough_that_fits_is_kept():
    options = parse_sglang_passthrough(["--sglang-ep-size", "8", "--sglang-enable-dp-attention", "--sglang-dp-size",
                                        "8", "--sglang-enable-dp-lm-head"])
    check_parallel_passthrough(options, 8)
    config, _ = load_config(["--rollout-num-gpus-per-engine", "8", "--sglang-ep-size", "8"], "train_async")
    assert config.sglang_args["ep-size"] == "8"
    with pytest.raises(ConfigError, match="--sglang-ep-size 8 must divide --rollout-num-gpus-per-engine 4"):
        load_config(["--rollout-num-gpus-per-engine", "4", "--sglang-ep-size", "8"], "train_async")


def test_a_checkpoint_made_at_start_up_is_checked_once_it_exists(tmp_path):
    """--hf-checkpoint-init makes the model at start-up: the flag is checked again then (dense: refused)."""
    from miles_disagg.loop.preflight import prepare_run

    argv = ["--hf-checkpoint", str(tmp_path / "tiny"), "--hf-checkpoint-init", "tiny-qwen3-digits",
            "--use-rollout-routing-replay", "--run-dir", str(tmp_path / "run")]
    config, _ = load_config(argv, "train_async")  # nothing to read yet
    with pytest.raises(ConfigError, match="is a dense model"):
        prepare_run(config)


def test_engines_this_job_does_not_launch_are_not_sized_by_the_passthrough():
    options = parse_sglang_passthrough(["--sglang-ep-size", "8"])
    check_parallel_passthrough(options, None)  # attached engines / a rollout service: their own launch lines
    with pytest.raises(ConfigError, match="set by --use-rollout-routing-replay"):
        check_parallel_passthrough(parse_sglang_passthrough(["--sglang-enable-return-routed-experts"]), None)
    config, _ = load_config(["--rollout-external", "--rollout-external-engine-addrs", "h:1", "--sglang-ep-size", "8"],
                            "train_async")
    assert config.sglang_args["ep-size"] == "8"
