"""Parsing of SGLang request bodies: field names, defaults, and InvalidInput on bad input."""

from __future__ import annotations

import pytest

from miles_disagg.engine import protocol
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
        protocol.parse_json(raw)


def test_update_from_disk_accepts_int_or_string_versions():
    assert protocol.UpdateFromDisk.from_json({"model_path": "p", "weight_version": 3}).weight_version == "3"
    req = protocol.UpdateFromDisk.from_json({"model_path": "p", "weight_version": "v3", "abort_all_requests": True})
    assert req.weight_version == "v3" and req.abort_all_requests and req.flush_cache
    for body in ({}, {"model_path": ""}, {"model_path": "p", "weight_version": 1.5}, {"model_path": "p", "flush_cache": 1}):
        with pytest.raises(InvalidInput):
            protocol.UpdateFromDisk.from_json(body)


def test_pause_modes_and_abort():
    assert protocol.parse_pause_mode({}) == "abort"
    assert protocol.parse_pause_mode({"mode": "in_place"}) == "in_place"
    with pytest.raises(InvalidInput):
        protocol.parse_pause_mode({"mode": "later"})
    assert protocol.parse_abort({"rid": "r"}) == ("r", False)
    assert protocol.parse_abort({"abort_all": True}) == ("", True)


def test_pull_and_group_requests():
    pull = protocol.PullWeights.from_json({"target_version": "4", "source_dir": "s", "local_checkpoint_dir": "l"})
    assert pull.target_version == 4
    with pytest.raises(InvalidInput):
        protocol.PullWeights.from_json({"target_version": -1, "source_dir": "s", "local_checkpoint_dir": "l"})
    group = protocol.InitGroup.from_json({"master_address": "h", "master_port": 1234, "rank_offset": 1, "world_size": 2})
    assert group.group_name == "weight_update_group" and group.backend == "nccl"
    with pytest.raises(InvalidInput):
        protocol.InitGroup.from_json({"master_address": "h", "master_port": 1234, "rank_offset": 2, "world_size": 2})
    upd = protocol.DistributedUpdate.from_json({"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]})
    assert upd.shapes == ((2, 3),) and upd.flush_cache
    with pytest.raises(InvalidInput):
        protocol.DistributedUpdate.from_json({"names": ["a"], "dtypes": [], "shapes": [[2]]})
