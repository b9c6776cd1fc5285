"""Sampling: truncation knobs, seeded reproducibility, and the reported (post-temperature) logprob."""

from __future__ import annotations

import torch

from miles_disagg.engines.builtin.protocol import SamplingParams
from miles_disagg.engines.builtin.sampling import make_generator, sample_token

LOGITS = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0, 3.0])


def test_greedy_picks_argmax_and_reports_untempered_logprob():
    token, logprob = sample_token(LOGITS, SamplingParams(temperature=0.0), make_generator(0))
    assert token == 5
    assert abs(logprob - float(torch.log_softmax(LOGITS, -1)[5])) < 1e-6


def test_logprob_is_post_temperature_pre_truncation():
    params = SamplingParams(temperature=0.7, top_k=2, top_p=0.9)
    expected = torch.log_softmax(LOGITS / 0.7, -1)
    for seed in range(20):
        token, logprob = sample_token(LOGITS, params, make_generator(seed))
        assert token in (0, 5)  # top_k=2
        assert abs(logprob - float(expected[token])) < 1e-6


def test_top_p_and_min_p_truncate():
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-6)
    assert {sample_token(LOGITS, tiny_p, make_generator(s))[0] for s in range(20)} == {5}
    strict_min_p = SamplingParams(temperature=1.0, min_p=0.99)
    assert {sample_token(LOGITS, strict_min_p, make_generator(s))[0] for s in range(20)} == {5}


def test_seeded_generators_reproduce_and_differ():
    params = SamplingParams(temperature=5.0)
    draws = lambda seed: [sample_token(LOGITS, params, g)[0] for g in [make_generator(seed)] for _ in range(30)]
    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_top_logprobs_come_from_the_reported_distribution():
    from miles_disagg.engines.builtin.sampling import top_logprobs

    params = SamplingParams(temperature=0.7, top_k=2)
    expected = torch.log_softmax(LOGITS / 0.7, -1)
    top = top_logprobs(LOGITS, params, 3)
    assert [t for _, t in top] == [5, 0, 1]
    assert all(abs(lp - float(expected[t])) < 1e-6 for lp, t in top)
    token, logprob = sample_token(LOGITS, params, make_generator(0))
    assert any(t == token and lp == logprob for lp, t in top)
    assert len(top_logprobs(LOGITS, SamplingParams(temperature=0.0), 100)) == LOGITS.numel()
