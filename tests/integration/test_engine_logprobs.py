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
