"""Reported logprobs equal a trainer's recomputation (one forward pass, same weights, float32).

The engine reports ``log_softmax(logits / T)[token]``: after temperature, before
top-p/top-k/min-p truncation (SGLang's default). Greedy requests use ``T = 1``.
"""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import engine  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def trainer_model(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def _recompute(model, prompt: list[int], output: list[int], temperature: float) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    positions = range(len(prompt) - 1, len(prompt) + len(output) - 1)
    return [float(logprobs[pos, tok]) for pos, tok in zip(positions, output)]


CASES = {
    "T=0.7": ({"temperature": 0.7}, 0.7),
    "T=1.3 top_p top_k min_p": ({"temperature": 1.3, "top_p": 0.8, "top_k": 30, "min_p": 0.01}, 1.3),
    "greedy": ({"temperature": 0.0}, 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logprobs_match_one_forward_pass(engine, trainer_model, case):
    engine.require_builtin("recomputes with the engine's checkpoint")
    params, temperature = CASES[case]
    prompts = [[5, 6, 7, 8, 9], [30, 31], [60, 61, 62]]
    body = {"input_ids": prompts, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "sampling_seed": 7, **params}}
    results = engine.generate(body)  # batched: exercises padded, shared decode steps
    for prompt, result in zip(prompts, results):
        reported = [t[0] for t in result["meta_info"]["output_token_logprobs"]]
        expected = _recompute(trainer_model, prompt, result["output_ids"], temperature)
        assert max(abs(a - b) for a, b in zip(reported, expected)) < TOLERANCE


def test_logprobs_match_when_requests_join_and_leave_mid_batch(engine, trainer_model):
    """Continuous batching: a request that joins a running batch (left-padded KV merge) and
    one that leaves early still report the trainer's numbers."""
    engine.require_builtin("recomputes with the engine's checkpoint")
    from engine_fixtures import Background, wait_in_flight

    def body(prompt, n):
        return {"input_ids": prompt, "return_logprob": True,
                "sampling_params": {"max_new_tokens": n, "temperature": 0.8, "ignore_eos": True, "sampling_seed": 11}}

    cases = [([5, 6, 7, 8, 9, 10, 11], 400), ([30, 31], 8), ([60, 61, 62], 20)]
    first = Background(lambda: engine.generate(body(*cases[0])))
    wait_in_flight(engine, [first])
    later = [Background(lambda c=c: engine.generate(body(*c))) for c in cases[1:]]
    for (prompt, _), request in zip(cases, [first, *later]):
        result = request.result()
        reported = [t[0] for t in result["meta_info"]["output_token_logprobs"]]
        expected = _recompute(trainer_model, prompt, result["output_ids"], 0.8)
        assert max(abs(a - b) for a, b in zip(reported, expected)) < TOLERANCE


# --------------------------------------------------------------------------- input-token logprobs


def _input_logprobs(model, tokens: list[int]) -> list[float]:
    """``log_softmax(logits)`` (no temperature) of each token after the first, given the ones before."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[pos - 1, tok]) for pos, tok in enumerate(tokens) if pos > 0]


@pytest.mark.parametrize("start", [0, 3])
def test_a_scoring_call_reports_the_prompt_tokens_from_logprob_start_len(engine, trainer_model, start):
    """SGLang's semantics: one entry per prompt token from ``logprob_start_len`` on, the first with a
    null logprob; ``max_new_tokens`` 0 generates nothing and still runs the prefill."""
    engine.require_builtin("recomputes with the engine's checkpoint")
    prompt = [5, 6, 7, 8, 9, 10, 11]
    result = engine.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": start,
                              "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}})
    meta = result["meta_info"]
    assert result["output_ids"] == [] and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["weight_version"] == engine.version()
    entries = meta["input_token_logprobs"]
    assert [e[1] for e in entries] == prompt[start:] and entries[0][0] is None
    expected = _input_logprobs(trainer_model, prompt)[start:]
    assert max(abs(e[0] - x) for e, x in zip(entries[1:], expected, strict=True)) < TOLERANCE


def test_input_logprobs_ignore_the_temperature_and_leave_generation_unchanged(engine, trainer_model):
    """Scoring the prompt in the same request as generation: input logprobs use the raw logits
    (SGLang's), output logprobs the temperature's, and the sampled tokens are those of a request
    without scoring (same seed)."""
    engine.require_builtin("recomputes with the engine's checkpoint")
    prompts = [[5, 6, 7, 8, 9], [30, 31], [60, 61, 62]]
    params = {"max_new_tokens": 8, "temperature": 0.7, "ignore_eos": True, "sampling_seed": 3}
    plain = engine.generate({"input_ids": prompts, "return_logprob": True, "sampling_params": params})
    scored = engine.generate({"input_ids": prompts, "return_logprob": True, "logprob_start_len": [0, 1, 2],
                              "top_logprobs_num": 2, "sampling_params": params})
    for prompt, start, a, b in zip(prompts, [0, 1, 2], plain, scored):
        assert a["meta_info"]["input_token_logprobs"] == []  # SGLang's default -1: none
        assert b["output_ids"] == a["output_ids"]
        assert [t[0] for t in b["meta_info"]["output_token_logprobs"]] == \
            pytest.approx([t[0] for t in a["meta_info"]["output_token_logprobs"]], abs=TOLERANCE)
        entries = b["meta_info"]["input_token_logprobs"]
        assert [e[1] for e in entries] == prompt[start:]
        expected = _input_logprobs(trainer_model, prompt)[start:]
        assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=TOLERANCE)
        top = b["meta_info"]["input_top_logprobs"]
        assert len(top) == len(entries) and top[0] is None
        assert all(len(row) == 2 and row[0][0] >= row[1][0] and row[0][0] >= entry[0] - TOLERANCE
                   for row, entry in zip(top[1:], entries[1:]))  # the most likely first, none below the token


def test_logprob_start_len_at_the_prompt_end_is_empty_and_past_it_is_refused(engine):
    engine.require_builtin("the built-in engine's scoring")
    prompt = [5, 6, 7]
    at_end = engine.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": len(prompt),
                              "sampling_params": {"max_new_tokens": 0}})
    assert at_end["meta_info"]["input_token_logprobs"] == []
    last = engine.generate({"input_ids": prompt, "return_logprob": True, "logprob_start_len": len(prompt) - 1,
                            "sampling_params": {"max_new_tokens": 0}})
    assert last["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]
    refused = engine.post("/generate", {"input_ids": prompt, "return_logprob": True,
                                        "logprob_start_len": len(prompt) + 1, "sampling_params": {"max_new_tokens": 0}})
    assert refused.status_code == 400 and "logprob_start_len" in refused.text
    # without return_logprob the field is ignored (SGLang's rule): nothing to score, nothing refused
    ignored = engine.generate({"input_ids": prompt, "logprob_start_len": 99, "sampling_params": {"max_new_tokens": 1}})
    assert "input_token_logprobs" not in ignored["meta_info"]


def test_a_text_prompt_is_scored_with_text(engine, trainer_model):
    engine.require_builtin("recomputes with the engine's checkpoint")
    result = engine.generate({"text": "hello", "return_logprob": True, "logprob_start_len": 0,
                              "return_text_in_logprobs": True, "sampling_params": {"max_new_tokens": 0}})
    entries = result["meta_info"]["input_token_logprobs"]
    assert entries[0][0] is None and all(isinstance(e[2], str) for e in entries)
    expected = _input_logprobs(trainer_model, [e[1] for e in entries])
    assert [e[0] for e in entries[1:]] == pytest.approx(expected, abs=TOLERANCE)
