"""Wire details SGLang clients (miles' rollout and weight-update code in particular) rely on.

Each test names the client behaviour it protects. Runs against the built-in engine, or
against the server at ``MILES_DISAGG_ENGINE_URL``; built-in-only checks skip with a reason.
"""

from __future__ import annotations

import pytest

from engine_fixtures import engine, long_request, wait_in_flight, wait_until  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_model_info_and_server_info_aliases(engine):
    """miles reads the version from GET /model_info first and server args from GET /server_info."""
    version = engine.get("/get_weight_version").json()["weight_version"]
    assert isinstance(version, str)
    model_info = engine.get("/model_info")
    assert model_info.status_code == 200 and model_info.json()["weight_version"] == version
    assert engine.get("/get_model_info").json()["weight_version"] == version
    server_info = engine.get("/server_info")
    assert server_info.status_code == 200
    assert isinstance(server_info.json()["internal_states"], list) and "version" in server_info.json()


def test_pause_without_mode_aborts_in_flight(engine):
    """SGLang's PauseGenerationReqInput.mode defaults to "abort"."""
    request = long_request(engine, "pause-default")
    wait_in_flight(engine, [request])
    assert engine.post("/pause_generation", {}).status_code == 200
    try:
        finish = request.result()["meta_info"]["finish_reason"]
    finally:
        assert engine.post("/continue_generation", {}).status_code == 200
    assert finish["type"] == "abort"


def test_abort_finish_reason_has_sglang_keys(engine):
    """FINISH_ABORT.to_json(): type, message, status_code (null for a plain abort), err_type."""
    request = long_request(engine, "abort-shape")
    wait_in_flight(engine, [request])
    assert engine.post("/abort_request", {"rid": "abort-shape"}).status_code == 200
    finish = request.result()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and isinstance(finish["message"], str)
    assert "status_code" in finish and finish["status_code"] is None and "err_type" in finish


def test_flush_cache_refused_while_requests_run(engine):
    """miles polls GET /flush_cache until 200 to know the engine is idle."""
    request = long_request(engine, "flush-busy")
    wait_in_flight(engine, [request])
    try:
        assert engine.get("/flush_cache").status_code == 400
    finally:
        engine.post("/abort_request", {"rid": "flush-busy"})
    request.result()
    wait_until(lambda: engine.get("/flush_cache").status_code == 200, what="flush once idle")


def test_flush_cache_succeeds_after_a_retract_pause(engine):
    """miles' update path is pause(retract) -> GET /flush_cache (retried until 200) -> update."""
    engine.require_builtin("stock SGLang refuses to flush with retracted requests; miles' SGLang branch allows it")
    request = long_request(engine, "flush-retract")
    wait_in_flight(engine, [request])
    assert engine.post("/pause_generation", {"mode": "retract"}).status_code == 200
    try:
        assert engine.get("/flush_cache").status_code == 200
    finally:
        assert engine.post("/continue_generation", {}).status_code == 200
    assert request.result()["meta_info"]["finish_reason"]["type"] == "length"


def test_batched_string_rid_is_a_prefix(engine):
    """GenerateReqInput._normalize_rid: a string rid for a batch becomes rid_0, rid_1, ..."""
    results = engine.generate({"input_ids": [[5, 6], [7, 8]], "rid": "grp",
                               "sampling_params": {"max_new_tokens": 2, **GREEDY}})
    assert [r["meta_info"]["id"] for r in results] == ["grp_0", "grp_1"]


def test_duplicate_rid_in_flight_is_4xx(engine):
    """An rid must name one request, or /abort_request could not say which."""
    engine.require_builtin("SGLang's duplicate-rid check differs by version")
    request = long_request(engine, "dup-rid")
    wait_in_flight(engine, [request])
    try:
        response = engine.post("/generate", {"input_ids": [1, 2], "rid": "dup-rid",
                                             "sampling_params": {"max_new_tokens": 1}})
        assert 400 <= response.status_code < 500, response.text
    finally:
        engine.post("/abort_request", {"rid": "dup-rid"})
    assert request.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert engine.generate({"input_ids": [1, 2], "rid": "dup-rid", "sampling_params": {"max_new_tokens": 1}})


def test_matched_stop_token_is_trimmed_from_text_only(engine):
    """SGLang drops a matched stop token from ``text`` (not from output_ids) unless no_stop_trim."""
    prompt = [40, 41]
    greedy = engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, **GREEDY}})["output_ids"]
    stop_at = greedy[3]
    cut = greedy.index(stop_at)
    params = {"max_new_tokens": 8, "stop_token_ids": [stop_at], **GREEDY}
    stopped = engine.generate({"input_ids": prompt, "sampling_params": params})
    assert stopped["output_ids"] == greedy[: cut + 1]
    before = engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": cut, **GREEDY}})
    through = engine.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": cut + 1, **GREEDY}})
    assert stopped["text"] == (before["text"] if cut else "")
    kept = engine.generate({"input_ids": prompt, "sampling_params": {**params, "no_stop_trim": True}})
    assert kept["text"] == through["text"]


def test_return_text_in_logprobs(engine):
    result = engine.generate({"input_ids": [5, 6], "return_logprob": True, "return_text_in_logprobs": True,
                              "sampling_params": {"max_new_tokens": 3, **GREEDY}})
    triples = result["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == result["output_ids"] and all(isinstance(t[2], str) for t in triples)


def test_weight_versions_spans_cover_the_output(engine):
    """Newer SGLang reports meta_info.weight_versions: [{version, start, end}] over output tokens."""
    result = engine.generate({"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 4, **GREEDY}})
    meta = result["meta_info"]
    if "weight_versions" not in meta:
        pytest.skip("this server predates SGLang's weight_versions spans")
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 4}]


@pytest.mark.parametrize("knob", [{"n": 2}, {"repetition_penalty": 1.3}, {"min_new_tokens": 4},
                                  {"regex": "a+"}])
def test_unsupported_sampling_knobs_are_refused(engine, knob):
    engine.require_builtin("SGLang implements these knobs")
    response = engine.post("/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, **knob}})
    assert response.status_code == 400 and knob.popitem()[0] in response.json()["error"]["message"]


def test_no_op_values_of_unsupported_knobs_are_served(engine):
    """Clients often send SGLang's defaults explicitly (miles: n=1, penalties 1.0/0.0)."""
    params = {"max_new_tokens": 2, "n": 1, "repetition_penalty": 1.0, "frequency_penalty": 0.0,
              "presence_penalty": 0.0, "min_new_tokens": 0, "regex": None, "spaces_between_special_tokens": False}
    assert engine.generate({"input_ids": [1, 2], "sampling_params": params})["meta_info"]["completion_tokens"] == 2


def test_generate_accepts_put(engine):
    response = engine.client.put("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 1


def test_weight_update_session_endpoints_acknowledge(engine):
    """miles brackets broadcast updates with /begin_weight_update and /end_weight_update."""
    engine.require_builtin("only miles' SGLang branch has these endpoints")
    before = engine.version()
    for path, body in (("/begin_weight_update", {"selector": "all"}), ("/end_weight_update", {})):
        response = engine.post(path, body)
        assert response.status_code == 200 and response.json()["success"] is True
    assert engine.version() == before


def test_destroy_unknown_group_is_4xx(engine):
    response = engine.post("/destroy_weights_update_group", {"group_name": "never-made"})
    assert 400 <= response.status_code < 500 and response.json()["success"] is False


@pytest.mark.parametrize("body", [
    {"names": "w", "dtypes": ["float32"], "shapes": [[1]]},
    {"names": ["w"], "dtypes": ["float32"], "shapes": [[-1]]},
    {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": [3]},
])
def test_distributed_update_with_bad_fields_is_4xx(engine, body):
    before = engine.version()
    response = engine.post("/update_weights_from_distributed", body)
    assert 400 <= response.status_code < 500, response.text
    assert engine.version() == before


def test_miles_rollout_payload_is_served_as_miles_reads_it(engine):
    """The body miles' compute_request_payload sends, read the way update_sample_from_response reads it."""
    payload = {
        "input_ids": [11, 12, 13],
        "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "stop": None,
                            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
                            "spaces_between_special_tokens": False, "sampling_seed": 3},
        "return_logprob": True, "return_routed_experts": False, "return_indexer_topk": False,
    }
    output = engine.generate(payload)
    meta = output["meta_info"]
    triples = meta["output_token_logprobs"]
    tokens, logprobs = [t[1] for t in triples], [t[0] for t in triples]
    assert tokens == output["output_ids"] and len(logprobs) == meta["completion_tokens"]
    assert isinstance(output["text"], str) and isinstance(meta["weight_version"], str)
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert meta.get("routed_experts") is None and meta.get("indexer_topk") is None


def test_top_logprobs_num_rows_match_the_sampled_tokens(engine):
    """miles' --rollout-top-logprobs-num reads meta_info.output_top_logprobs: one row per token."""
    result = engine.generate({"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 3,
                              "sampling_params": {"max_new_tokens": 5, "temperature": 0.9, "sampling_seed": 4,
                                                  "ignore_eos": True}})
    meta = result["meta_info"]
    rows = meta["output_top_logprobs"]
    assert len(rows) == meta["completion_tokens"] and all(len(row) == 3 for row in rows)
    for (logprob, token, _), row in zip(meta["output_token_logprobs"], rows):
        assert [e[0] for e in row] == sorted((e[0] for e in row), reverse=True)
        for candidate_logprob, candidate, _ in row:
            if candidate == token:
                assert abs(candidate_logprob - logprob) < 1e-5
