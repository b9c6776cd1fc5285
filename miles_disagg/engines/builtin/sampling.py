"""Per-request sampling and the logprob the engine reports.

Reported logprob (SGLang's default, ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset): the log
probability of the sampled token under the *sampling distribution after temperature and
before top-p/top-k/min-p truncation*, i.e. ``log_softmax(logits / T)[token]``; for greedy
requests (``temperature`` ~ 0) SGLang uses ``T = 1``, and so do we. A trainer recomputing
``log_softmax(logits / T)`` over prompt + output with the same weights gets the same
numbers (to float32 rounding).

Each request has its own ``torch.Generator``: seeded by ``sampling_seed`` when given
(reproducible regardless of batch mates), otherwise from the engine's seeded RNG.
"""

from __future__ import annotations

import torch

GREEDY_EPS = 1e-6


def sample_token(logits: torch.Tensor, params, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from float32 ``logits`` ``[vocab]``; return ``(token_id, logprob)``."""
    logprobs = reported_logprobs(logits, params)
    if params.temperature < GREEDY_EPS or params.top_k == 1:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    probs = _truncated(logprobs.exp(), params)
    token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


def reported_logprobs(logits: torch.Tensor, params) -> torch.Tensor:
    """The distribution reported logprobs come from: ``log_softmax(logits / T)``, ``T = 1`` if greedy."""
    temperature = params.temperature
    return torch.log_softmax(logits if temperature < GREEDY_EPS else logits / temperature, dim=-1)


def top_logprobs(logits: torch.Tensor, params, k: int) -> list[tuple[float, int]]:
    """SGLang's ``top_logprobs_num``: the ``k`` most likely ``(logprob, token_id)`` of that distribution."""
    values, ids = torch.topk(reported_logprobs(logits, params), min(k, logits.numel()))
    return list(zip(values.tolist(), ids.tolist()))


def ids_logprobs(logits: torch.Tensor, params, ids: tuple[int, ...]) -> list[tuple[float, int]]:
    """SGLang's ``token_ids_logprob`` at an output token: ``(logprob, id)`` of each id asked, in order."""
    return list(zip(reported_logprobs(logits, params)[list(ids)].tolist(), ids))


def _truncated(probs: torch.Tensor, params) -> torch.Tensor:
    """Apply top-k, top-p and min-p to ``probs`` (renormalization is left to multinomial)."""
    if params.top_k > 0 and params.top_k < probs.numel():
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = sorted_probs.cumsum(0)
        drop_sorted = (cumulative - sorted_probs) > params.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def make_generator(seed: int) -> torch.Generator:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return generator
