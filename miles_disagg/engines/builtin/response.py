"""SGLang's ``/generate`` response object for one sequence (finished or still running).

Shape (SGLang's tokenizer manager, default options)::

    {"text": str, "output_ids": [int],
     "meta_info": {"id", "finish_reason" (null while running), "prompt_tokens",
                   "completion_tokens", "cached_tokens", "weight_version",
                   "weight_versions": [{"version", "start", "end"}],  # spans of output tokens
                   "e2e_latency", "output_token_logprobs": [[logprob, token_id, text|null]],
                   "output_top_logprobs": [[[logprob, token_id, text|null] x top_logprobs_num]],
                   "input_token_logprobs": [[logprob|null, token_id, text|null]],  # with return_logprob
                   "input_top_logprobs": [null | [[logprob, token_id, text|null] x top_logprobs_num]],
                   # with token_ids_logprob (SGLang's) or token_ids_logprob_positions (miles' patch):
                   "input_token_ids_logprobs": [null | [[logprob, token_id, text|null] per id asked]],
                   "output_token_ids_logprobs": [[[logprob, token_id, text|null] per id asked]]}}

Input logprobs (``logprob_start_len`` >= 0, with ``return_logprob``) score the prompt's tokens from
that position on with the raw logits (SGLang applies no temperature to them); the first entry's
logprob is null, as in SGLang. With ``max_new_tokens`` 0 the request is a pure scoring call.

``text`` follows SGLang's stop trimming: a matched stop string is cut off and so is a
matched stop token (``output_ids`` keeps every token), unless ``no_stop_trim``.
``weight_version_start``/``weight_version_end`` and ``num_retractions`` are this project's
additions. With ``return_routed_experts`` a finished sequence's ``meta_info["routed_experts"]`` is
SGLang's (:mod:`miles_disagg.models.routed_experts_wire`): base64 of little-endian int32 ``[prompt +
output - 1 - routed_experts_start_len, num_hidden_layers, top_k]``, row ``p`` the experts of the token
at position ``start_len + p`` (-1 on layers without experts). Streaming chunks use the same shape with cumulative ``text``/``output_ids``.
"""

from __future__ import annotations

import time

from miles_disagg.engines.builtin.sequence import Sequence
from miles_disagg.models.routed_experts_wire import ROUTED_EXPERTS_FIELD, START_LEN_FIELD, encode_routed_experts


def result_json(seq: Sequence, tokenizer) -> dict:
    params = seq.item.sampling
    finish = seq.finish.to_json() if seq.finish else None
    meta = {
        "id": seq.rid,
        "finish_reason": finish,
        "prompt_tokens": len(seq.prompt_ids),
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": seq.cached_tokens,
        "weight_version": seq.version_end,
        "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in seq.version_spans],
        "weight_version_start": seq.version_start,
        "weight_version_end": seq.version_end,
        "num_retractions": seq.num_retractions,
        "e2e_latency": round(time.monotonic() - seq.created_s, 6),
    }
    if seq.item.return_logprob:
        meta.update(input_logprobs(seq, tokenizer))
        meta["output_token_logprobs"] = _logprob_triples(seq, tokenizer)
        if seq.item.top_logprobs_num:
            meta["output_top_logprobs"] = [_triples(row, tokenizer, seq.item.return_text_in_logprobs)
                                           for row in seq.output_top_logprobs]
        if seq.item.wants_token_ids:
            meta["output_token_ids_logprobs"] = [_triples(row, tokenizer, seq.item.return_text_in_logprobs)
                                                 for row in seq.output_token_ids_logprobs]
    if seq.item.return_routed_experts and seq.finish is not None:
        meta[ROUTED_EXPERTS_FIELD] = routed_experts_payload(seq)
        meta[START_LEN_FIELD] = seq.item.routed_experts_start_len
    text = _trimmed_text(seq, tokenizer, finish, params.no_stop_trim, params.skip_special_tokens)
    return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}


def input_logprobs(seq: Sequence, tokenizer) -> dict:
    """SGLang's ``input_token_logprobs`` (and ``input_top_logprobs`` with ``top_logprobs_num``): one
    entry per prompt token from ``logprob_start_len`` on, the first ``[null, token_id, text|null]``;
    empty without ``logprob_start_len`` (SGLang's default -1)."""
    scores, with_text = seq.input_scores, seq.item.return_text_in_logprobs
    start = seq.item.logprob_start_len
    if scores is None:
        fields = {"input_token_logprobs": []}
        if seq.item.top_logprobs_num:
            fields["input_top_logprobs"] = []
        if seq.item.wants_token_ids:
            fields["input_token_ids_logprobs"] = []
        return fields
    tokens = seq.prompt_ids[start:]
    fields = {"input_token_logprobs": _triples(list(zip(scores.token_logprobs, tokens)), tokenizer, with_text)}
    for name, rows in (("input_top_logprobs", scores.top_logprobs),
                       ("input_token_ids_logprobs", scores.token_ids_logprobs)):
        if rows is not None:
            fields[name] = [None if row is None else _triples(row, tokenizer, with_text) for row in rows]
    return fields


def routed_experts_payload(seq: Sequence) -> str:
    """The recorded routing of positions ``start_len .. seqlen - 2`` (the last token was never fed),
    in SGLang's wire format (:mod:`miles_disagg.models.routed_experts_wire`)."""
    import torch

    fed = len(seq.all_ids) - 1
    rows = torch.cat(seq.routed)[:fed] if seq.routed else torch.zeros((0,), dtype=torch.int32)
    return encode_routed_experts(rows.numpy(), seq.item.routed_experts_start_len)


def _trimmed_text(seq: Sequence, tokenizer, finish: dict | None, no_stop_trim: bool, skip_special: bool) -> str:
    matched = finish.get("matched") if finish and not no_stop_trim else None
    ids = seq.output_ids
    if isinstance(matched, int) and ids:
        ids = ids[:-1]  # SGLang drops the matched stop token from the text
    text = tokenizer.decode(ids, skip_special_tokens=skip_special)
    if isinstance(matched, str) and matched in text:
        text = text[: text.index(matched)]
    return text


def _logprob_triples(seq: Sequence, tokenizer) -> list[list]:
    pairs = list(zip(seq.output_logprobs, seq.output_ids))
    return _triples(pairs, tokenizer, seq.item.return_text_in_logprobs)


def _triples(pairs: list[tuple[float, int]], tokenizer, with_text: bool) -> list[list]:
    """SGLang's ``[logprob, token_id, token_text | null]`` entries."""
    return [[lp, tok, tokenizer.decode([tok]) if with_text else None] for lp, tok in pairs]
