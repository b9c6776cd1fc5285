"""The model calls of one scheduler step: what each forward pass feeds the model and keeps of it.

A cold batched prefill, a prefix-cache hit's extension over its new tokens, a batched decode; each
runs with its rows' LoRA adapters and records routed experts and input scores where a request asked.
The prefix cache's lookups and inserts are here too, always under the weights key they were computed
with (:attr:`Scheduler.cache_key`), so KV never crosses weights. Scheduler thread only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Hashable

import torch

from miles_disagg.engines.builtin.model_runner import KVBatch, ModelRunner
from miles_disagg.engines.builtin.prefix_cache import PrefixCache
from miles_disagg.engines.builtin.sequence import Sequence, cache_namespace, input_scoring, wants_routing


class ForwardPasses:
    """The scheduler's forward passes over ``runner``, with ``prefix_cache`` and (``--enable-lora``)
    the ``lora`` bank (engines/builtin/lora.py's ``LoraBank``)."""

    def __init__(self, runner: ModelRunner, prefix_cache: PrefixCache, lora: Any = None):
        self.runner, self.prefix_cache, self.lora = runner, prefix_cache, lora

    def cached_prefix(self, seq: Sequence, cache_key: Hashable):
        """The cached KV of ``seq``'s longest cached prefix (at least one token left to run), or None.
        Requests that need every prompt position's forward pass (input logprobs, routed experts)
        skip the lookup."""
        seq.cached_tokens = 0
        if not self.prefix_cache.enabled or seq.item.return_routed_experts or seq.item.wants_input_logprobs:
            return None
        tokens = seq.all_ids
        seq.cached_tokens, past = self.prefix_cache.match(tokens, cache_key, len(tokens) - 1, cache_namespace(seq))
        return past

    def extend(self, seq: Sequence, past) -> tuple[torch.Tensor, KVBatch]:
        """Run ``seq``'s tokens after its cached prefix over that prefix's KV."""
        with self.adapters([seq]):
            return self.runner.extend(past, seq.all_ids[seq.cached_tokens:])

    def prefill(self, joining: list[Sequence]) -> tuple[torch.Tensor, KVBatch]:
        """One batched prefill of the whole of each joining sequence."""
        scoring = [input_scoring(seq) for seq in joining]
        with self.adapters(joining):
            logits, kv = self.runner.prefill([seq.all_ids for seq in joining], wants_routing(joining),
                                             scoring if any(s is not None for s in scoring) else None)
        for offset, seq in enumerate(joining):
            if seq.item.return_routed_experts and self.runner.last_routed is not None:
                seq.routed = [self.runner.last_routed[offset, -len(seq.all_ids):]]
            if scoring[offset] is not None:
                seq.input_scores = self.runner.last_input_scores[offset]
        return logits, kv

    def decode(self, kv: KVBatch, running: list[Sequence]) -> torch.Tensor:
        """One batched decode step of the running rows, each fed its last token."""
        with self.adapters(running):
            logits = self.runner.decode(kv, [seq.output_ids[-1] for seq in running], wants_routing(running))
        for row, seq in enumerate(running):
            if seq.item.return_routed_experts and self.runner.last_routed is not None:
                seq.routed.append(self.runner.last_routed[row])  # the token fed at this step
        return logits

    def remember(self, seq: Sequence, kv: KVBatch | None, row: int, cache_key: Hashable) -> None:
        """A finishing row's KV joins the prefix cache, unless it was computed under other weights."""
        if not self.prefix_cache.enabled or seq.cache_key != cache_key or kv is None:
            return
        layers = self.runner.row_layers(kv, row)
        self.prefix_cache.insert(seq.all_ids[:layers[0][0].shape[1]], layers, cache_key, cache_namespace(seq))

    def adapters(self, rows: list[Sequence]):
        """The LoRA adapters of a forward pass's rows (a no-op without --enable-lora)."""
        return self.lora.rows([seq.adapter for seq in rows]) if self.lora is not None else contextlib.nullcontext()
