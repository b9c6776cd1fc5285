"""One request in flight on the built-in engine's scheduler, and the rules that concern it alone.

A :class:`Sequence` holds its tokens, sampling state, versions and where its progress goes (a
:class:`Sink`); the functions below say when it finishes, what its prefill scores of its prompt and
which prefix-cache partition it reads and fills. The scheduler (``scheduler.py``) owns the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Hashable, Protocol

import torch

from miles_disagg.engines.builtin.model_runner import InputScores, InputScoring
from miles_disagg.engines.builtin.protocol import FinishReason, GenerateItem
from miles_disagg.engines.builtin.sampling import ids_logprobs, sample_token, top_logprobs


class Sink(Protocol):
    """Where a sequence's progress goes (the HTTP layer bridges it to the event loop)."""

    def on_token(self, seq: "Sequence") -> None: ...

    def on_finish(self, seq: "Sequence") -> None: ...


@dataclass
class Sequence:
    """One request in flight: its tokens, sampling state, versions and result sink."""

    item: GenerateItem
    prompt_ids: list[int]
    generator: torch.Generator
    sink: Sink
    stop_ids: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    version_start: str | None = None
    version_end: str | None = None
    finish: FinishReason | None = None
    num_retractions: int = 0
    created_s: float = field(default_factory=time.monotonic)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    output_token_ids_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """``token_ids_logprob``: the asked ids' ``(logprob, id)`` at each output token."""
    version_spans: list[list] = field(default_factory=list)
    """SGLang's ``weight_versions``: ``[version, start, end)`` over output-token indices."""
    routed: list[torch.Tensor] = field(default_factory=list)
    """``return_routed_experts``: int32 ``[positions, layers, top_k]`` chunks, one per forward pass
    that fed this sequence tokens, in position order (a re-prefill after a retraction starts over)."""
    input_scores: InputScores | None = None
    """SGLang's input logprobs (``logprob_start_len``), from the first prefill (a re-prefill after a
    retraction keeps them, as SGLang does)."""
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache at the (last) prefill (SGLang's meta_info)."""
    adapter: Any = None
    """The LoRA adapter it runs with (:class:`~miles_disagg.engines.builtin.lora.ResidentAdapter`; None:
    the base), held from admission to its end."""
    cache_key: Hashable | None = None
    """The weights key (:attr:`Scheduler.cache_key`) its KV was computed under; None until its prefill.
    Its KV joins the prefix cache at the end only if the key is still live (never mixed-version KV)."""

    @property
    def rid(self) -> str:
        return self.item.rid

    def sample(self, logits: torch.Tensor, version: str) -> int:
        """Sample the next token from this row's ``logits``, with the logprobs the request asked for,
        recorded as produced by ``version``'s forward pass."""
        token, logprob = sample_token(logits, self.item.sampling, self.generator)
        if self.item.top_logprobs_num:
            self.output_top_logprobs.append(top_logprobs(logits, self.item.sampling, self.item.top_logprobs_num))
        if self.item.token_ids_logprob and self.item.return_logprob:
            self.output_token_ids_logprobs.append(ids_logprobs(logits, self.item.sampling,
                                                               self.item.token_ids_logprob))
        self.record_token(token, logprob, version)
        return token

    def record_token(self, token: int, logprob: float, version: str) -> None:
        """Append a sampled token and the weight version whose forward pass produced it."""
        self.output_ids.append(token)
        self.output_logprobs.append(logprob)
        self.version_end = version
        count = len(self.output_ids)
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][2] = count
        else:
            self.version_spans.append([version, count - 1, count])

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class StopTextChecker(Protocol):
    def __call__(self, seq: Sequence) -> str | None: ...


def finish_reason(seq: Sequence, token: int, stop_text: StopTextChecker, max_context: int) -> FinishReason | None:
    """Why ``seq`` ends after sampling ``token`` (a stop id or text, its length, the context), or None."""
    params = seq.item.sampling
    if token in seq.stop_ids and not params.ignore_eos:
        return FinishReason("stop", {"matched": token})
    if token in params.stop_token_ids:
        return FinishReason("stop", {"matched": token})
    if params.stop:
        matched = stop_text(seq)
        if matched is not None:
            return FinishReason("stop", {"matched": matched})
    if len(seq.output_ids) >= params.max_new_tokens:
        return FinishReason("length", {"length": params.max_new_tokens})
    if len(seq.all_ids) >= max_context:
        return FinishReason("length", {"length": len(seq.output_ids)})
    return None


def input_scoring(seq: Sequence) -> InputScoring | None:
    """What this sequence's prefill scores of its prompt (None: nothing, or already scored)."""
    if not seq.item.wants_input_logprobs or seq.input_scores is not None:
        return None
    return InputScoring(seq.item.logprob_start_len, seq.item.top_logprobs_num, seq.item.token_ids_logprob,
                        seq.item.token_ids_logprob_positions)


def cache_namespace(seq: Sequence) -> Hashable:
    """The prefix-cache partition a request reads and fills (SGLang's ``extra_key``; a LoRA adapter's
    KV is its own)."""
    return seq.item.extra_key if seq.adapter is None else (seq.item.extra_key, "lora", seq.adapter.key)


def wants_routing(rows: list[Sequence]) -> bool:
    """Record routed experts only in the forward passes of batches where some request asked."""
    return any(seq.item.return_routed_experts for seq in rows)
