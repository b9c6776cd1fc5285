"""Parsing of SGLang request bodies: field names, defaults, and InvalidInput on bad input."""

from __future__ import annotations

import pytest

from miles_disagg.engines.builtin import control_bodies, protocol
from miles_disagg.net.httpjson import parse_json
from miles_disagg.types import InvalidInput


def test_single_text_request_uses_sglang_defaults():
    req = protocol.parse_generate({"text": "hi"})
    assert not req.batched and not req.stream and len(req.items) == 1
    item = req.items[0]
    assert item.text == "hi" and item.input_ids is None and item.rid
    assert item.sampling == protocol.SamplingParams()
    assert item.sampling.max_new_tokens == 128 and item.sampling.top_k == -1


def test_batched_input_ids_share_or_split_per_item_fields():
    req = protocol.parse_generate({
        "input_ids": [[1, 2], [3]], "rid": ["a", "b"], "return_logprob": [True, False],
        "sampling_params": {"max_new_tokens": 3, "stop": "x"},
    })
    assert req.batched and [i.rid for i in req.items] == ["a", "b"]
    assert [i.return_logprob for i in req.items] == [True, False]
    assert all(i.sampling.max_new_tokens == 3 and i.sampling.stop == ("x",) for i in req.items)


@pytest.mark.parametrize("body", [
    {}, {"text": "a", "input_ids": [1]}, {"text": []}, {"text": 5}, {"input_ids": []}, {"input_ids": [1, True]},
    {"input_ids": [[1], 2]}, {"text": "a", "rid": ["x", "y"]}, {"text": "a", "stream": "yes"},
    {"text": ["a", "b"], "stream": True},
    {"text": "a", "sampling_params": {"max_new_tokens": -1}},
    {"text": "a", "sampling_params": {"max_new_tokens": 1.5}},
    {"text": "a", "sampling_params": {"temperature": "1"}},
    {"text": "a", "sampling_params": {"top_p": 0}},
    {"text": "a", "sampling_params": {"top_k": -2}},
    {"text": "a", "sampling_params": {"min_p": 2}},
    {"text": "a", "sampling_params": {"stop": [""]}},
    {"text": "a", "sampling_params": {"stop_token_ids": ["1"]}},
    {"text": "a", "sampling_params": {"ignore_eos": 1}},
    {"text": "a", "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]},
])
def test_bad_generate_bodies_raise_invalid_input(body):
    with pytest.raises(InvalidInput):
        protocol.parse_generate(body)


@pytest.mark.parametrize("raw", [b"{", b"[1]", b"\xff", b'"s"'])
def test_parse_json_rejects_non_objects(raw):
    with pytest.raises(InvalidInput):
        parse_json(raw)


def test_update_from_disk_accepts_int_or_string_versions():
    assert control_bodies.UpdateFromDisk.from_json({"model_path": "p", "weight_version": 3}).weight_version == "3"
    req = control_bodies.UpdateFromDisk.from_json({"model_path": "p", "weight_version": "v3", "abort_all_requests": True})
    assert req.weight_version == "v3" and req.abort_all_requests and req.flush_cache
    for body in ({}, {"model_path": ""}, {"model_path": "p", "weight_version": 1.5}, {"model_path": "p", "flush_cache": 1}):
        with pytest.raises(InvalidInput):
            control_bodies.UpdateFromDisk.from_json(body)


def test_pause_modes_and_abort():
    assert control_bodies.PauseGeneration.from_json({}).mode == "abort"
    assert control_bodies.PauseGeneration.from_json({"mode": "in_place"}).mode == "in_place"
    with pytest.raises(InvalidInput):
        control_bodies.PauseGeneration.from_json({"mode": "later"})
    abort = control_bodies.AbortReq.from_json({"rid": "r"})
    assert (abort.rid, abort.abort_all) == ("r", False)
    abort = control_bodies.AbortReq.from_json({"abort_all": True})
    assert (abort.rid, abort.abort_all) == ("", True)


def test_pull_and_group_requests():
    pull = control_bodies.PullWeights.from_json({"target_version": 4, "source_dir": "s", "local_checkpoint_dir": "l"})
    assert pull.target_version == 4
    for wrong in (-1, "4", 4.0, True, None, [4]):  # a string is refused like every other wrong type (issue 30)
        with pytest.raises(InvalidInput, match="target_version"):
            control_bodies.PullWeights.from_json({"target_version": wrong, "source_dir": "s", "local_checkpoint_dir": "l"})
    group = control_bodies.InitGroup.from_json({"master_address": "h", "master_port": 1234, "rank_offset": 1, "world_size": 2})
    assert group.group_name == "weight_update_group" and group.backend == "nccl"
    with pytest.raises(InvalidInput):
        control_bodies.InitGroup.from_json({"master_address": "h", "master_port": 1234, "rank_offset": 2, "world_size": 2})
    upd = control_bodies.DistributedUpdate.from_json({"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]})
    assert upd.shapes == ((2, 3),) and upd.flush_cache
    with pytest.raises(InvalidInput):
        control_bodies.DistributedUpdate.from_json({"names": ["a"], "dtypes": [], "shapes": [[2]]})


def test_batch_rid_string_is_a_prefix_and_rids_must_be_distinct():
    req = protocol.parse_generate({"input_ids": [[1], [2], [3]], "rid": "g"})
    assert [i.rid for i in req.items] == ["g_0", "g_1", "g_2"]
    assert protocol.parse_generate({"input_ids": [1], "rid": "solo"}).items[0].rid == "solo"
    with pytest.raises(InvalidInput):
        protocol.parse_generate({"input_ids": [[1], [2]], "rid": ["same", "same"]})


@pytest.mark.parametrize("knob", [{"n": 2}, {"min_new_tokens": 3}, {"repetition_penalty": 1.1},
                                  {"frequency_penalty": 0.5}, {"presence_penalty": -0.5}, {"json_schema": "{}"},
                                  {"regex": "x"}, {"ebnf": "r"}])
def test_unimplemented_sampling_knobs_are_refused_unless_no_op(knob):
    with pytest.raises(InvalidInput, match=next(iter(knob))):
        protocol.SamplingParams.from_json(knob)


def test_no_op_sampling_knobs_are_accepted():
    params = {"n": 1, "min_new_tokens": 0, "repetition_penalty": 1.0, "frequency_penalty": 0,
              "presence_penalty": 0.0, "json_schema": None, "regex": None, "spaces_between_special_tokens": True}
    assert protocol.SamplingParams.from_json(params) == protocol.SamplingParams()


def test_finish_reason_abort_has_sglang_keys():
    assert protocol.FinishReason.abort("gone").to_json() == {
        "type": "abort", "message": "gone", "status_code": None, "err_type": None}
    fault = protocol.FinishReason.abort("boom", 500, "InternalServerError")
    assert fault.status_code == 500 and protocol.FinishReason("length", {"length": 3}).status_code is None


def test_return_text_in_logprobs_and_group_name():
    req = protocol.parse_generate({"input_ids": [1], "return_logprob": True, "return_text_in_logprobs": True})
    assert req.items[0].return_text_in_logprobs
    assert control_bodies.DestroyGroup.from_json({}).group_name == "weight_update_group"
    with pytest.raises(InvalidInput):
        control_bodies.DestroyGroup.from_json({"group_name": 3})


@pytest.mark.parametrize("field", [{"logprob_start_len": -2}, {"top_logprobs_num": -1}, {"token_ids_logprob": [[1]]},
                                   {"return_hidden_states": True}, {"lora_path": ["a"]}, {"image_data": "x.png"},
                                   {"logprob_start_len": [-1, 0, 1]}, {"logprob_start_len": 1.5}])
def test_unimplemented_or_malformed_generate_fields_are_refused(field):
    with pytest.raises(InvalidInput, match=next(iter(field))):
        protocol.parse_generate({"input_ids": [[1], [2]], **field})


def test_no_op_generate_fields_are_accepted():
    body = {"input_ids": [[1], [2]], "logprob_start_len": -1, "top_logprobs_num": [0, 0], "return_hidden_states": False,
            "return_routed_experts": False, "return_indexer_topk": False, "lora_path": None, "image_data": None}
    assert len(protocol.parse_generate(body).items) == 2


def test_logprob_start_len_is_per_item_and_kept_only_with_return_logprob():
    """SGLang's input logprobs: one start per item (or one for the batch); without ``return_logprob``
    SGLang ignores the field, and so does the parsed item."""
    req = protocol.parse_generate({"input_ids": [[1, 2], [3]], "return_logprob": [True, False],
                                   "logprob_start_len": [1, 0]})
    assert [i.logprob_start_len for i in req.items] == [1, -1]
    assert [i.wants_input_logprobs for i in req.items] == [True, False]
    shared = protocol.parse_generate({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 0})
    assert shared.items[0].logprob_start_len == 0 and shared.items[0].wants_input_logprobs
    assert protocol.parse_generate({"input_ids": [1], "return_logprob": True}).items[0].logprob_start_len == -1
    protocol.check_logprob_start_len(shared.items[0], 3)
    late = protocol.parse_generate({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}).items[0]
    with pytest.raises(InvalidInput, match="logprob_start_len=3"):
        protocol.check_logprob_start_len(late, 2)


def test_a_nul_byte_in_a_path_field_is_invalid_input():
    for kind, body in ((control_bodies.PullWeights, {"target_version": 1, "source_dir": "/s\x00/x"}),
                       (control_bodies.PullWeights, {"target_version": 1, "source_dir": "/s", "local_checkpoint_dir": "\x00"}),
                       (control_bodies.UpdateFromDisk, {"model_path": "/m\x00"})):
        with pytest.raises(InvalidInput, match="NUL"):
            kind.from_json(body)


def test_a_version_constraint_sent_to_the_engine_is_refused_not_ignored():
    for constraint in ({"min_version": 2}, {"exact_version": 2}, 3, "3"):
        with pytest.raises(InvalidInput, match="weight_version.*router"):
            protocol.parse_generate({"input_ids": [1, 2], "weight_version": constraint})
    assert protocol.parse_generate({"input_ids": [1, 2]}).items
