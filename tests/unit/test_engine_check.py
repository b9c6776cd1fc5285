"""Attach-time engine checks against realistic /get_server_info and /get_model_info bodies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.engines.check import (
    EngineExpectation, check_engine_matches, normalize_dtype, sglang_auto_dtype, unreported_fields,
)
from miles_disagg.types import ConfigError


def _checkpoint(tmp_path: Path, **overrides) -> Path:
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": "bfloat16",
              "max_position_embeddings": 40960, "hidden_size": 2560, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _sglang_server_info(**overrides) -> dict:
    """The shape of SGLang's /get_server_info: server_args + scheduler info + internal states."""
    return {"model_path": "/models/Qwen3-4B", "tokenizer_path": "/models/Qwen3-4B", "host": "0.0.0.0",
            "port": 30000, "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "dtype": "auto",
            "context_length": None, "mem_fraction_static": 0.8, "trust_remote_code": True,
            "weight_version": "default", "max_total_num_tokens": 500000, "max_req_input_len": 40955,
            "internal_states": [{"last_gen_throughput": 0.0}], "version": "0.5.4", **overrides}


def _sglang_model_info(**overrides) -> dict:
    return {"model_path": "/models/Qwen3-4B", "tokenizer_path": "/models/Qwen3-4B", "is_generation": True,
            "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
            "has_audio_understanding": False, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"],
            **overrides}


def _builtin_server_info(**overrides) -> dict:
    """The built-in engine's /get_server_info (engine/runtime.py server_info())."""
    return {"tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "nnodes": 1, "node_rank": 0,
            "model_path": "/tmp/model", "tokenizer_path": "/tmp/model", "host": "127.0.0.1", "port": 30000,
            "device": "cpu", "dtype": "float32", "max_running_requests": 64, "random_seed": 0,
            "context_length": 2048, "max_req_input_len": 2047, "weight_version": "0",
            "version": "miles-disagg-builtin-0.1.0", "internal_states": [{"paused_mode": None}], **overrides}


def test_expectation_reads_the_checkpoint(tmp_path):
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=2)
    assert expected.architectures == ("Qwen3ForCausalLM",) and expected.model_type == "qwen3"
    assert expected.tp_size == 2 and expected.dtype == "bfloat16" and expected.checkpoint_dtype == "bfloat16"
    assert expected.context_length == 40960 == expected.checkpoint_context_length


def test_expectation_reads_transformers5_dtype_key_and_explicit_values(tmp_path):
    path = _checkpoint(tmp_path, torch_dtype=None, dtype="float32")
    expected = EngineExpectation.from_hf_checkpoint(path, tp_size=1, dtype="half", context_length=4096)
    assert expected.checkpoint_dtype == "float32" and expected.dtype == "float16" and expected.context_length == 4096


def test_expectation_needs_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        EngineExpectation.from_hf_checkpoint(tmp_path, tp_size=1)
    with pytest.raises(ConfigError, match="torch_dtype"):
        EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path, torch_dtype=None), tp_size=1)


def test_sglang_engine_with_defaults_matches(tmp_path):
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=1)
    assert check_engine_matches(expected, _sglang_server_info(), _sglang_model_info()) == []


def test_builtin_engine_shapes_match_a_float32_checkpoint(tmp_path):
    path = _checkpoint(tmp_path, torch_dtype="float32", max_position_embeddings=2048)
    expected = EngineExpectation.from_hf_checkpoint(path, tp_size=1)
    assert check_engine_matches(expected, _builtin_server_info(), _sglang_model_info()) == []


def test_every_mismatch_names_the_field_and_both_values(tmp_path):
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=4)
    server = _sglang_server_info(tp_size=2, dtype="half", context_length=8192)
    model = _sglang_model_info(architectures=["LlamaForCausalLM"], model_type="llama")
    problems = check_engine_matches(expected, server, model)
    assert len(problems) == 4, problems
    arch, tp, dtype, context = problems
    assert arch.startswith("architectures:") and "LlamaForCausalLM" in arch and "Qwen3ForCausalLM" in arch
    assert tp.startswith("tp_size:") and "2" in tp and "--rollout-num-gpus-per-engine is 4" in tp
    assert dtype.startswith("dtype:") and "float16" in dtype and "'half'" in dtype and "bfloat16" in dtype
    assert context.startswith("context_length:") and "8192" in context and "40960" in context


def test_sglang_auto_dtype_serves_float32_checkpoints_in_float16(tmp_path):
    path = _checkpoint(tmp_path, torch_dtype="float32")
    expected = EngineExpectation.from_hf_checkpoint(path, tp_size=1)
    problems = check_engine_matches(expected, _sglang_server_info(dtype="auto"), _sglang_model_info())
    assert problems == ["dtype: the engine serves float16 (reported as 'auto'), the job expects float32"]
    fp16_job = EngineExpectation.from_hf_checkpoint(path, tp_size=1, dtype="float16")
    assert check_engine_matches(fp16_job, _sglang_server_info(dtype="auto"), _sglang_model_info()) == []


def test_context_length_is_a_requirement_not_an_equality(tmp_path):
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=1, context_length=8192)
    for served in (8192, 32768, None):  # None: SGLang uses the checkpoint's 40960
        assert check_engine_matches(expected, _sglang_server_info(context_length=served), _sglang_model_info()) == []
    assert check_engine_matches(expected, _sglang_server_info(context_length=4096), _sglang_model_info()) == [
        "context_length: the engine accepts 4096 tokens, the job needs 8192"]


def test_older_engines_without_architectures_compare_model_type(tmp_path):
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=1)
    older = {"model_path": "/m", "tokenizer_path": "/m", "is_generation": True}
    assert check_engine_matches(expected, _sglang_server_info(), {**older, "model_type": "qwen3"}) == []
    assert check_engine_matches(expected, _sglang_server_info(), {**older, "model_type": "llama"}) == [
        "model_type: the engine serves 'llama', the job's checkpoint has 'qwen3'"]


def test_unreported_fields_are_named(tmp_path):
    assert unreported_fields(_sglang_server_info(), _sglang_model_info()) == []
    assert unreported_fields({"dtype": "auto"}, {"model_path": "/m"}) == ["architectures", "tp_size", "context_length"]


@pytest.mark.parametrize("name, canonical", [
    ("half", "float16"), ("float", "float32"), ("torch.bfloat16", "bfloat16"), ("BF16", "bfloat16"), ("auto", "auto"),
])
def test_dtype_spellings(name, canonical):
    assert normalize_dtype(name) == canonical


def test_sglang_auto_rule():
    assert sglang_auto_dtype("float32") == "float16" and sglang_auto_dtype("bfloat16") == "bfloat16"


def test_a_server_answering_empty_objects_matches_nothing(tmp_path):
    """``{}`` to everything: every compared field is absent, and absent means refused."""
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=1)
    problems = check_engine_matches(expected, {}, {})
    assert [p.split(":")[0] for p in problems] == ["architectures", "tp_size", "dtype", "context_length"], problems
    assert "neither architectures nor model_type" in problems[0]
    assert all("does not report it" in p for p in problems[1:]), problems


@pytest.mark.parametrize("server, model, expected", [
    ({"tp_size": "one"}, {}, "tp_size: the engine reports 'one' in /server_info, not a number"),
    ({"tp_size": True}, {}, "tp_size: the engine reports True in /server_info, not a number"),
    ({"dtype": 5}, {}, "dtype: the engine reports 5 in /server_info, not a dtype name"),
    ({"context_length": "long"}, {}, "context_length: the engine reports 'long' in /server_info, not a number"),
    ({}, {"architectures": 5}, "architectures: the engine reports 5 in /model_info, not a list of names"),
    ({}, {"architectures": None, "model_type": ["qwen3"]}, "model_type: the engine reports ['qwen3'] in /model_info"),
], ids=["tp-text", "tp-bool", "dtype-number", "context-text", "architectures-number", "model-type-list"])
def test_wrongly_typed_answers_are_problems_naming_the_field(tmp_path, server, model, expected):
    matches = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=1)
    problems = check_engine_matches(matches, _sglang_server_info(**server), _sglang_model_info(**model))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


def test_answers_that_are_not_objects_are_named(tmp_path):
    expected = EngineExpectation.from_hf_checkpoint(_checkpoint(tmp_path), tp_size=1)
    assert check_engine_matches(expected, [], "x") == ["/server_info answered a list, not a JSON object",
                                                       "/model_info answered a string, not a JSON object"]
