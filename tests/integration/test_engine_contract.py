"""Contract tests: drive the engine over HTTP exactly as a SGLang client does.

Runs against the built-in engine by default, or against any SGLang-compatible server
given by ``MILES_DISAGG_ENGINE_URL`` (see ``engine_fixtures``).
"""

from __future__ import annotations

import itertools

import httpx
import pytest

from engine_fixtures import (  # noqa: F401  (``engine`` is a fixture)
    LONG_TOKENS, engine, long_request, running_count, sse_events, wait_in_flight, wait_until,
)

pytestmark = pytest.mark.timeout(120)
_versions = itertools.count(100)


def _fresh_version() -> str:
    return str(next(_versions))


def _model_path(engine) -> str:
    return engine.get("/get_model_info").json()["model_path"]


def _assert_generate_shape(result: dict, *, logprobs: bool) -> None:
    assert isinstance(result["text"], str)
    assert all(isinstance(t, int) for t in result["output_ids"])
    meta = result["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version"):
        assert key in meta, key
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    assert meta["completion_tokens"] == len(result["output_ids"])
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert [t[1] for t in triples] == result["output_ids"]
        assert all(isinstance(t[0], float) and t[0] <= 0.0 and t[2] is None for t in triples)


# --------------------------------------------------------------------------- /generate


def test_generate_text_reports_sglang_fields(engine):
    result = engine.generate({"text": "abc", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True},
                              "return_logprob": True})
    _assert_generate_shape(result, logprobs=True)
    meta = result["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["completion_tokens"] == 6 and meta["prompt_tokens"] >= 1
    assert meta["weight_version"] == engine.version()


def test_generate_input_ids_batched(engine):
    body = {"input_ids": [[5, 6, 7], [8, 9]], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
            "return_logprob": True}
    results = engine.generate(body)
    assert isinstance(results, list) and len(results) == 2
    for result in results:
        _assert_generate_shape(result, logprobs=True)
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [3, 2]


def test_builtin_reports_version_start_and_end(engine):
    engine.require_builtin("weight_version_start/end are this project's addition")
    meta = engine.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})["meta_info"]
    assert meta["weight_version_start"] == meta["weight_version_end"] == meta["weight_version"]


def test_greedy_is_deterministic_and_batch_invariant(engine):
    params = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    alone = engine.generate({"input_ids": [10, 11, 12], "sampling_params": params})["output_ids"]
    batch = engine.generate({"input_ids": [[20, 21], [10, 11, 12], [30]], "sampling_params": params})
    assert batch[1]["output_ids"] == alone


def test_sampling_seed_reproduces(engine):
    params = {"max_new_tokens": 10, "temperature": 1.0, "sampling_seed": 1234, "ignore_eos": True}
    first = engine.generate({"input_ids": [3, 4, 5], "sampling_params": params})["output_ids"]
    second = engine.generate({"input_ids": [3, 4, 5], "sampling_params": params})["output_ids"]
    assert first == second


def test_stop_token_ids_stop_generation(engine):
    params = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    greedy = engine.generate({"input_ids": [40, 41], "sampling_params": params})["output_ids"]
    stop_at = greedy[2]
    first = greedy.index(stop_at)
    result = engine.generate({"input_ids": [40, 41], "sampling_params": {**params, "stop_token_ids": [stop_at]}})
    assert result["meta_info"]["finish_reason"]["type"] == "stop"
    assert result["meta_info"]["finish_reason"].get("matched") == stop_at
    assert result["output_ids"] == greedy[: first + 1]


def test_stop_string_is_trimmed_unless_no_stop_trim(engine):
    params = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
    text = engine.generate({"text": "hello", "sampling_params": params})["text"]
    stop = text[3:5]
    if not stop.strip() or len(stop) < 2:
        pytest.skip(f"greedy text {text!r} has no usable stop string")
    trimmed = engine.generate({"text": "hello", "sampling_params": {**params, "stop": [stop]}})
    assert trimmed["meta_info"]["finish_reason"]["type"] == "stop"
    assert trimmed["meta_info"]["finish_reason"].get("matched") == stop
    assert trimmed["text"] == text[: text.index(stop)]
    kept = engine.generate({"text": "hello", "sampling_params": {**params, "stop": stop, "no_stop_trim": True}})
    assert kept["text"].endswith(stop)


def test_sampling_knobs_accepted(engine):
    params = {"max_new_tokens": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
              "skip_special_tokens": False, "ignore_eos": True}
    result = engine.generate({"input_ids": [1, 2, 3], "sampling_params": params, "return_logprob": True})
    _assert_generate_shape(result, logprobs=True)
    assert result["meta_info"]["completion_tokens"] == 5


def test_stream_returns_sse_chunks_then_done(engine):
    response = engine.post("/generate", {"text": "xy", "stream": True,
                                         "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    final = events[-2]
    assert final["meta_info"]["finish_reason"]["type"] == "length"
    assert len(final["output_ids"]) == 4 or final["meta_info"]["completion_tokens"] == 4


def test_concurrent_requests_share_decode_steps(engine):
    engine.require_builtin("counts scheduler steps")
    before = engine.internal_state()["num_steps"]
    requests = [long_request(engine, f"share-{i}", max_new_tokens=40) for i in range(8)]
    results = [r.result() for r in requests]
    steps = engine.internal_state()["num_steps"] - before
    assert all(r["meta_info"]["completion_tokens"] == 40 for r in results)
    assert steps < 8 * 40 / 2, f"{steps} steps for 8 x 40 tokens: requests were not batched"


# --------------------------------------------------------------------------- info endpoints


def test_info_and_health_endpoints(engine):
    info = engine.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    assert "weight_version" in info
    server = engine.get("/get_server_info")
    assert server.status_code == 200 and isinstance(server.json(), dict)
    assert engine.get("/health").status_code == 200
    assert engine.get("/health_generate").status_code == 200
    assert engine.get("/flush_cache").status_code == 200
    assert engine.post("/flush_cache").status_code == 200


def test_update_weight_version(engine):
    old = engine.version()
    new = _fresh_version()
    response = engine.post("/update_weight_version", {"new_version": new})
    assert response.status_code == 200 and response.json()["success"] is True
    assert engine.version() == new
    meta = engine.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})["meta_info"]
    assert meta["weight_version"] == new
    assert engine.post("/update_weight_version", {"new_version": old}).status_code == 200


# --------------------------------------------------------------------------- abort and pause modes


def test_abort_request_by_rid(engine):
    request = long_request(engine, "abort-me")
    wait_in_flight(engine, [request])
    assert engine.post("/abort_request", {"rid": "abort-me"}).status_code == 200
    result = request.result()
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert result["meta_info"]["completion_tokens"] < LONG_TOKENS


def test_pause_abort_returns_in_flight_and_holds_new(engine):
    requests = [long_request(engine, f"pa-{i}") for i in range(2)]
    wait_in_flight(engine, requests)
    assert engine.post("/pause_generation", {"mode": "abort"}).status_code == 200
    try:
        for request in requests:
            meta = request.result()["meta_info"]
            assert meta["finish_reason"]["type"] == "abort"
            assert meta["completion_tokens"] < LONG_TOKENS
        held = long_request(engine, "pa-held", max_new_tokens=3)
        if engine.builtin:
            wait_until(lambda: engine.internal_state()["num_waiting_requests"] == 1, what="request held")
        assert not held.done()
    finally:
        assert engine.post("/continue_generation", {}).status_code == 200
    assert held.result()["meta_info"]["finish_reason"]["type"] == "length"


def _update_from_disk(engine, version: str) -> httpx.Response:
    return engine.post("/update_weights_from_disk", {"model_path": _model_path(engine), "weight_version": version})


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_update_continue_spans_activation(engine, mode):
    old = engine.version()
    new = _fresh_version()
    requests = [long_request(engine, f"{mode}-{i}") for i in range(2)]
    wait_in_flight(engine, requests)
    assert engine.post("/pause_generation", {"mode": mode}).status_code == 200
    try:
        if engine.builtin:
            state = engine.internal_state()
            assert state["paused_mode"] == mode
            if mode == "retract":
                assert state["num_running_requests"] == 0 and state["num_waiting_requests"] == 2
            else:
                assert state["num_running_requests"] == 2
                steps = state["num_steps"]
                assert engine.internal_state()["num_steps"] == steps  # nothing advances while paused
                assert engine.post("/flush_cache").status_code == 400  # SGLang: KV held in place
        assert not any(r.done() for r in requests)
        update = _update_from_disk(engine, new)
        assert update.status_code == 200, update.text
        assert update.json()["success"] is True
    finally:
        assert engine.post("/continue_generation", {}).status_code == 200
    for request in requests:
        meta = request.result()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == LONG_TOKENS
        assert meta["weight_version"] == new
        if engine.builtin:
            assert (meta["weight_version_start"], meta["weight_version_end"]) == (old, new)
            assert (meta["num_retractions"] >= 1) == (mode == "retract")
        _assert_spans(meta, old, new)


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_one_call_activation_spans_requests_in_flight(engine, mode):
    """``/activate_weights`` does pause, flush, load, continue and the version check itself: requests in
    flight see the same activation as with the per-step sequence above, and nothing is left paused."""
    if not engine.builtin:
        pytest.skip("/activate_weights is this project's endpoint")
    old, new = engine.version(), _fresh_version()
    requests = [long_request(engine, f"one-call-{mode}-{i}") for i in range(2)]
    wait_in_flight(engine, requests)
    answer = engine.post("/activate_weights", {"model_path": _model_path(engine), "weight_version": new,
                                               "pause_mode": mode})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["success"] is True and body["weight_version"] == new and body["activation"] == "disk"
    assert body["num_paused_requests"] == 2 and body["pause_ms"] >= body["load"]["pause_ms"] > 0
    assert engine.internal_state()["paused_mode"] is None and engine.version() == new
    for request in requests:
        meta = request.result()["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["completion_tokens"] == LONG_TOKENS
        assert (meta["weight_version_start"], meta["weight_version_end"]) == (old, new)
        assert (meta["num_retractions"] >= 1) == (mode == "retract")
        _assert_spans(meta, old, new)


def test_update_while_requests_run(engine):
    old = engine.version()
    new = _fresh_version()
    requests = [long_request(engine, f"live-{i}") for i in range(2)]
    wait_in_flight(engine, requests)
    update = _update_from_disk(engine, new)
    assert update.status_code == 200 and update.json()["success"] is True
    for request in requests:
        meta = request.result()["meta_info"]
        assert meta["completion_tokens"] == LONG_TOKENS and meta["weight_version"] == new
        if engine.builtin:
            assert meta["weight_version_start"] == old and meta["weight_version_end"] == new
        _assert_spans(meta, old, new)
    assert engine.version() == new


def test_prefix_cache_serves_a_continuing_prompt_until_a_flush_or_a_weight_update(engine):
    """SGLang's ``cached_tokens``: a prompt that continues a finished one reuses its KV; after
    ``/flush_cache`` or a weight update (the same label, other tensors) nothing is reused."""
    params = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    first = engine.generate({"input_ids": [40, 41, 42, 43, 44, 45], "sampling_params": params})
    turn = [40, 41, 42, 43, 44, 45] + first["output_ids"] + [46, 47]
    meta = engine.generate({"input_ids": turn, "sampling_params": params})["meta_info"]
    assert meta["cached_tokens"] == 6 + 5 - 1  # all but the last generated token (never fed)
    assert engine.post("/flush_cache").status_code == 200
    assert engine.generate({"input_ids": turn, "sampling_params": params})["meta_info"]["cached_tokens"] == 0
    assert engine.generate({"input_ids": turn, "sampling_params": params})["meta_info"]["cached_tokens"] == len(turn) - 1
    if engine.builtin:
        drops = engine.internal_state()["prefix_cache"]["num_drops"]
        assert _update_from_disk(engine, engine.version()).status_code == 200
        assert engine.generate({"input_ids": turn, "sampling_params": params})["meta_info"]["cached_tokens"] == 0
        cache = engine.internal_state()["prefix_cache"]
        assert cache["num_drops"] == drops + 1 and cache["cross_version_tokens"] == 0


def _assert_spans(meta: dict, old: str, new: str) -> None:
    """SGLang's ``weight_versions``: contiguous spans over the output, old weights then new."""
    spans = meta.get("weight_versions")
    if spans is None:  # servers before SGLang added the spans
        return
    assert [s["version"] for s in spans] == [old, new]
    assert spans[0]["start"] == 0 and spans[0]["end"] == spans[1]["start"] > 0
    assert spans[1]["end"] == meta["completion_tokens"]


# --------------------------------------------------------------------------- bad input


BAD_GENERATE_BODIES = {
    "no prompt": {"sampling_params": {"max_new_tokens": 2}},
    "both prompts": {"text": "a", "input_ids": [1]},
    "text wrong type": {"text": 5},
    "input_ids wrong type": {"input_ids": "abc"},
    "input_ids nested junk": {"input_ids": [[1, "x"]]},
    "max_new_tokens string": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "5"}},
    "max_new_tokens negative": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}},
    "max_new_tokens huge": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 10**12}},
    "temperature string": {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}},
    "negative temperature": {"input_ids": [1, 2], "sampling_params": {"temperature": -1.0}},
    "top_p out of range": {"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}},
    "sampling_params not an object": {"input_ids": [1, 2], "sampling_params": [1, 2]},
    "unknown token id": {"input_ids": [1, 10**9]},
    "negative token id": {"input_ids": [1, -1]},
}


@pytest.mark.parametrize("name", sorted(BAD_GENERATE_BODIES))
def test_bad_generate_input_is_4xx(engine, name):
    response = engine.post("/generate", BAD_GENERATE_BODIES[name])
    assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
    assert isinstance(response.json(), dict)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json_is_4xx(engine, raw):
    response = engine.client.post("/generate", content=raw, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text


def test_bad_pause_mode_is_4xx(engine):
    assert 400 <= engine.post("/pause_generation", {"mode": "sideways"}).status_code < 500
    assert engine.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})


POST_ENDPOINTS = ["/generate", "/update_weights_from_disk", "/pause_generation", "/continue_generation",
                  "/abort_request", "/update_weight_version", "/init_weights_update_group",
                  "/update_weights_from_distributed", "/destroy_weights_update_group", "/activate_weights"]


@pytest.mark.parametrize("path", POST_ENDPOINTS)
def test_malformed_json_on_every_post_endpoint_is_4xx(engine, path):
    before = engine.version()
    response = engine.client.post(path, content=b'{"mode": ', headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, (path, response.status_code, response.text)
    assert engine.version() == before and engine.internal_state().get("paused_mode") is None
    assert engine.generate({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})


@pytest.mark.parametrize("path,body", [
    ("/abort_request", {"rid": 5}), ("/abort_request", {"abort_all": "yes"}),
    ("/update_weight_version", {}), ("/update_weight_version", {"new_version": [1]}),
    ("/pause_generation", {"mode": 3}), ("/destroy_weights_update_group", {"group_name": 7}),
    ("/update_weights_from_disk", {"model_path": "x", "abort_all_requests": "no"}),
    ("/activate_weights", {}), ("/activate_weights", {"weight_version": "v7"}),
    ("/activate_weights", {"weight_version": "7", "pause_mode": "sideways"}),
    ("/activate_weights", {"weight_version": "7", "flush_cache": "no"}),
])
def test_wrong_typed_control_fields_are_4xx(engine, path, body):
    before = engine.version()
    response = engine.post(path, body)
    assert 400 <= response.status_code < 500, (path, response.status_code, response.text)
    assert engine.version() == before
    if engine.builtin:
        assert engine.internal_state()["paused_mode"] is None  # refused before anything paused


def _assert_rejected_update(engine, body: dict) -> None:
    before = engine.version()
    params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    reference = engine.generate({"input_ids": [7, 8, 9], "sampling_params": params})["output_ids"]
    response = engine.post("/update_weights_from_disk", body)
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["success"] is False and response.json()["message"]
    assert engine.version() == before
    assert engine.generate({"input_ids": [7, 8, 9], "sampling_params": params})["output_ids"] == reference


def test_update_from_missing_path_is_4xx_and_changes_nothing(engine, tmp_path):
    _assert_rejected_update(engine, {"model_path": str(tmp_path / "nope"), "weight_version": _fresh_version()})


def test_update_from_other_architecture_is_4xx_and_changes_nothing(engine, tmp_path):
    engine.require_builtin("the test writes a checkpoint on this machine")
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    other = make_tiny_qwen3(tmp_path / "other", hidden_size=32, head_dim=8, intermediate_size=64)
    _assert_rejected_update(engine, {"model_path": str(other), "weight_version": _fresh_version()})


@pytest.mark.parametrize("body", [{}, {"model_path": 5}, {"model_path": "x", "weight_version": [1]}])
def test_update_with_bad_fields_is_4xx(engine, body):
    before = engine.version()
    assert 400 <= engine.post("/update_weights_from_disk", body).status_code < 500
    assert engine.version() == before


def test_client_disconnect_frees_slot(engine):
    engine.require_builtin("reads the running-request count")
    body = {"input_ids": [5, 6], "rid": "gone", "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True}}
    aborted = engine.internal_state()["num_aborted_requests"]
    with httpx.Client(base_url=engine.url, timeout=httpx.Timeout(5.0, read=0.3)) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/generate", json=body)
    wait_until(lambda: running_count(engine) == 0, timeout=20, what="slot freed after disconnect")
    assert engine.internal_state()["num_aborted_requests"] == aborted + 1  # freed by abort, not by finishing


def test_stream_disconnect_frees_slot(engine):
    engine.require_builtin("reads the running-request count")
    body = {"input_ids": [5, 6], "stream": True,
            "sampling_params": {"max_new_tokens": LONG_TOKENS, "ignore_eos": True}}
    aborted = engine.internal_state()["num_aborted_requests"]
    with httpx.Client(base_url=engine.url, timeout=30.0) as client:
        with client.stream("POST", "/generate", json=body) as response:
            assert response.status_code == 200
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
            assert first
    wait_until(lambda: running_count(engine) == 0, timeout=20, what="slot freed after stream disconnect")
    assert engine.internal_state()["num_aborted_requests"] == aborted + 1  # freed by abort, not by finishing
