"""The on-policy distillation teacher (``rollout/teacher.py``) against a real built-in engine: each
sample's tokens scored with miles' request (``logprob_start_len`` 0, ``max_new_tokens`` 0), the
response's logprobs those of one forward pass of the teacher's checkpoint (raw logits), attributed
to the weight version the teacher reported; the start-up probe; and the answers refused."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from engine_fixtures import engine  # noqa: F401  (fixture)
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.teacher import Teacher, base_url, probe_teacher, read_scores, scoring_body
from miles_disagg.types import ConfigError, Sample

pytestmark = pytest.mark.timeout(180)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def teacher_model(tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()


def _expected(model, prompt: list[int], response: list[int]) -> list[float]:
    tokens = prompt + response
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=torch.tensor([tokens])).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) + i - 1, tok]) for i, tok in enumerate(response)]


def test_each_sample_is_scored_by_the_teacher_and_attributed_to_its_version(engine, teacher_model):
    engine.require_builtin("recomputes with the engine's checkpoint")
    samples = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], response_logprobs=[-1.0] * 4),
               Sample(prompt_ids=[30], response_ids=[31, 32], response_logprobs=[-1.0] * 2),
               Sample(prompt_ids=[40, 41, 42, 43, 44], response_ids=[45], response_logprobs=[-1.0])]

    async def score():
        client = httpx.AsyncClient(timeout=60)
        teacher = Teacher(client, f"{engine.url}/generate")
        try:
            await teacher.score(samples)
        finally:
            await teacher.aclose()
        return teacher

    teacher = asyncio.run(score())
    assert teacher.counters["requests"] == len(samples)  # one scoring call per sample
    for sample in samples:
        assert sample.teacher_logprobs == pytest.approx(_expected(teacher_model, sample.prompt_ids,
                                                                  sample.response_ids), abs=TOLERANCE)
        assert sample.teacher_version == engine.version()
        sample.check_consistent()
    assert probe_teacher(f"{engine.url}/generate", "--rm-url") == engine.version()
    assert probe_teacher(engine.url, "--rm-url") == engine.version()  # the server's address works too


def test_a_teacher_that_cannot_score_is_refused_at_start(engine):
    engine.require_builtin("the built-in engine's answers")
    with pytest.raises(ConfigError, match="--rm-url: the OPD teacher"):
        probe_teacher(f"{engine.url}/nothing-here/generate", "--rm-url", timeout_s=10)
    with pytest.raises(ConfigError, match="not reachable|does not score"):
        probe_teacher("http://127.0.0.1:9/generate", "--rm-url", timeout_s=5)


def test_answers_without_one_finite_logprob_per_token_fail_the_run():
    tokens = [1, 2, 3]
    good = {"meta_info": {"input_token_logprobs": [[None, 1, None], [-0.5, 2, None], [-0.25, 3, None]],
                          "weight_version": 7}}
    assert read_scores(good, tokens, 2) == ([-0.5, -0.25], "7")
    assert read_scores(good, tokens, 1) == ([-0.25], "7")
    short = {"meta_info": {"input_token_logprobs": [[None, 2, None], [-0.25, 3, None]]}}
    old_engine = {"meta_info": {"output_token_logprobs": []}}  # an engine that ignores logprob_start_len
    null = {"meta_info": {"input_token_logprobs": [[None, 1, None], [None, 2, None], [-0.25, 3, None]]}}
    for answer, reason in ((short, "2 input_token_logprobs for 3"), (old_engine, "no input_token_logprobs"),
                           (null, "token 1 is None")):
        with pytest.raises(GenerationFailed, match=reason):
            read_scores(answer, tokens, 2)


def test_miles_request_and_url_forms():
    assert scoring_body([4, 5]) == {"input_ids": [4, 5], "return_logprob": True, "logprob_start_len": 0,
                                    "sampling_params": {"temperature": 0, "max_new_tokens": 0,
                                                        "skip_special_tokens": False}}
    assert base_url("http://t:1/generate") == base_url("http://t:1/generate/") == base_url("http://t:1") == "http://t:1"
