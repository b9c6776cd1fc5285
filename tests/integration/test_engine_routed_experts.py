"""The built-in engine serves a Qwen3-MoE and, started with ``--enable-return-routed-experts``, answers
``return_routed_experts`` with SGLang's ``meta_info["routed_experts"]`` (base64 int32 ``[seqlen - 1 -
start_len, layers, top_k]``): per item of a batch, through KV-cached decode steps and rows joining a
running batch, equal to a fresh full forward's routing of the same tokens on the same weights."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from engine_fixtures import Background, inprocess_engine, start_engine, stop_engine, wait_in_flight
from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.models.routed_experts_wire import decode_routed_experts

pytestmark = pytest.mark.timeout(300)
LAYERS, TOP_K = 2, 2


@pytest.fixture(scope="module")
def moe_engine(tiny_qwen3_moe_dir, tmp_path_factory):
    handle = start_engine(tiny_qwen3_moe_dir, tmp_path_factory.mktemp("moe-engine"), "--enable-return-routed-experts")
    yield handle
    stop_engine(handle)


@pytest.fixture(scope="module")
def reference(tiny_qwen3_moe_dir):
    from miles_disagg.engines.builtin.model_runner import ModelRunner

    return ModelRunner(tiny_qwen3_moe_dir)


def _check(result: dict, prompt: list[int], reference, start: int = 0) -> None:
    tokens = prompt + result["output_ids"]
    routed = decode_routed_experts(result["meta_info"]["routed_experts"], LAYERS, TOP_K)
    assert result["meta_info"]["routed_experts_start_len"] == start
    assert routed.shape == (len(tokens) - 1 - start, LAYERS, TOP_K)
    fresh = reference.full_routed_experts(tokens)[:-1].numpy()
    assert (routed == fresh[start:]).all()
    assert ((routed >= 0) & (routed < 4)).all()
    assert all(len(set(row)) == TOP_K for row in routed.reshape(-1, TOP_K).tolist())


def test_routed_experts_equal_a_fresh_forward(moe_engine, reference):
    prompt = [5, 6, 7, 8, 9, 4]
    result = moe_engine.generate({"input_ids": prompt, "return_routed_experts": True,
                                  "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 3}})
    assert len(result["output_ids"]) == 12
    _check(result, prompt, reference)


def test_a_batch_answers_per_item_with_its_start_len(moe_engine, reference):
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    starts = [0, 3, 1]
    results = moe_engine.generate({"input_ids": prompts, "return_routed_experts": True,
                                   "routed_experts_start_len": starts,
                                   "sampling_params": {"max_new_tokens": 7, "ignore_eos": True, "sampling_seed": 4}})
    for prompt, start, result in zip(prompts, starts, results):
        _check(result, prompt, reference, start)


def test_rows_joining_a_running_batch_record_their_own_routing(moe_engine, reference):
    def body(prompt, n):
        return {"input_ids": prompt, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "sampling_seed": 9}}

    long = Background(lambda: moe_engine.generate(body([4, 5, 6, 7], 300)))
    wait_in_flight(moe_engine, [long])
    short = moe_engine.generate(body([9, 8, 7, 6, 5, 4, 3, 2], 6))  # left-padded into the running batch
    _check(short, [9, 8, 7, 6, 5, 4, 3, 2], reference)
    _check(long.result(), [4, 5, 6, 7], reference)


def test_server_info_announces_the_flag(moe_engine):
    assert moe_engine.get("/get_server_info").json()["enable_return_routed_experts"] is True


def test_without_the_request_field_there_is_no_routing(moe_engine):
    result = moe_engine.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert "routed_experts" not in result["meta_info"]


@pytest.mark.parametrize("body, match", [
    ({"routed_experts_start_len": 4}, "routed_experts_start_len must be in \\[0, 3\\]"),
    ({"routed_experts_start_len": -1}, "routed_experts_start_len"),
    ({"sampling_params": {"max_new_tokens": 0}}, "max_new_tokens=0"),
])
def test_bad_routed_experts_requests_are_400(moe_engine, body, match):
    import re

    response = moe_engine.post("/generate", {"input_ids": [5, 6, 7], "return_routed_experts": True, **body})
    assert response.status_code == 400 and re.search(match, response.text), response.text


def test_asking_a_server_not_started_with_the_flag_is_400_naming_it(tiny_qwen3_moe_dir):
    with inprocess_engine(tiny_qwen3_moe_dir) as (_engine, handle):
        response = handle.post("/generate", {"input_ids": [5, 6], "return_routed_experts": True})
        assert response.status_code == 400 and "--enable-return-routed-experts" in response.text
        plain = handle.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 3}})
        assert len(plain["output_ids"]) == 3  # the MoE model serves without the flag


def test_the_flag_on_a_dense_model_exits_2(tiny_qwen3_dir):
    proc = subprocess.run([sys.executable, "-m", "miles_disagg.engines.builtin", "--model-path", str(tiny_qwen3_dir),
                           "--port", "0", "--enable-return-routed-experts"], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--enable-return-routed-experts" in proc.stderr and "has no experts" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_request_asking_beside_one_that_does_not_gets_its_full_routing(moe_engine, reference):
    """Passes record only when some row asked: a row asking must not miss the passes that fed it."""
    plain = Background(lambda: moe_engine.generate(
        {"input_ids": [4, 5, 6, 7], "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}))
    wait_in_flight(moe_engine, [plain])
    asking = moe_engine.generate({"input_ids": [9, 8, 7], "return_routed_experts": True,
                                  "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 1}})
    _check(asking, [9, 8, 7], reference)
    assert "routed_experts" not in plain.result()["meta_info"]
