"""MoE routing replay, rollout side: ask the engines for the experts each token was routed to and
keep them on the sample (``Sample.rollout_routed_experts``).

The wire is SGLang 0.5.23's (:mod:`miles_disagg.models.routed_experts_wire`): a ``/generate`` body
with ``"return_routed_experts": true`` and ``"routed_experts_start_len": S`` is answered with
``meta_info["routed_experts"]``, int32 ``[seqlen - 1 - S, num_hidden_layers, num_experts_per_tok]``
(``seqlen``: the call's prompt plus output tokens), row ``p`` being the routing of the token at
absolute position ``S + p``; layers without experts hold -1.

The per-call rule: row ``p`` of a sample comes from the engine call that first ran position ``p``
through the model. A call asks for ``S`` = the rows the sample already holds, so the rows it
returns are exactly the positions it ran first (the last token of the previous turn and the
tool tokens after it, then its own prompt tail and output), and they are appended. A two-turn
sample served by versions 3 then 4 replays version 3's routing for the prompt and turn 1 and
version 4's for everything after.

Routing asked for and not returned (an engine started without ``--enable-return-routed-experts``,
a malformed payload, a sample whose rows do not cover its tokens) is :class:`RoutedExpertsMissing`:
the run stops rather than train a sample unreplayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from miles_disagg.models.routed_experts_wire import ROUTED_EXPERTS_FIELD, START_LEN_FIELD, RoutingWireError
from miles_disagg.models.routed_experts_wire import decode_routed_experts as decode_payload
from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.samples import Sample

ENGINE_FLAG = "--enable-return-routed-experts"
"""The server flag (SGLang's; the built-in engine takes the same)."""


class RoutedExpertsMissing(GenerationFailed):
    """Routing was asked for and an answer does not carry it (or carries something malformed)."""


@dataclass(frozen=True)
class RoutingShape:
    """What one row of routing holds: ``num_hidden_layers`` x ``num_experts_per_tok`` int32."""

    num_layers: int
    top_k: int

    def __post_init__(self) -> None:
        if self.num_layers < 1 or self.top_k < 1:
            raise ValueError(f"a routing row needs layers >= 1 and top-k >= 1, got {self.num_layers} x {self.top_k}")

    @property
    def per_row(self) -> int:
        return self.num_layers * self.top_k


def request_fields(sample_rows: int, prompt_len: int) -> dict[str, Any]:
    """The top-level ``/generate`` fields of a call sending ``prompt_len`` tokens for a sample that
    holds ``sample_rows`` rows (the call returns positions ``sample_rows`` onwards)."""
    if not 0 <= sample_rows <= prompt_len:
        raise RoutedExpertsMissing(f"a sample holds routing for {sample_rows} positions but sends only {prompt_len} "
                                   "tokens: its tokens were cut after the engines routed them")
    return {"return_routed_experts": True, START_LEN_FIELD: int(sample_rows)}


def rows_held(sample: Sample) -> int:
    """Rows of routing the sample holds so far (0 before its first call)."""
    routed = sample.rollout_routed_experts
    return 0 if routed is None else int(routed.shape[0])


def decode_routed_experts(meta: dict | None, rows: int | None, shape: RoutingShape):
    """``meta_info["routed_experts"]`` as a numpy int32 ``[rows, layers, top_k]`` array (``rows``
    None: as many as it holds); :class:`RoutedExpertsMissing` naming what is wrong otherwise."""
    encoded = meta.get(ROUTED_EXPERTS_FIELD) if isinstance(meta, dict) else None
    if encoded is None:
        raise RoutedExpertsMissing(f"routing replay asked the engine for routed experts and its answer has no "
                                   f"meta_info[{ROUTED_EXPERTS_FIELD!r}]: start every engine with {ENGINE_FLAG}")
    try:
        return decode_payload(encoded, shape.num_layers, shape.top_k, rows)
    except RoutingWireError as exc:
        raise RoutedExpertsMissing(str(exc)) from None


def append_call_routing(sample: Sample, meta: dict, *, start_len: int, seqlen: int, shape: RoutingShape) -> None:
    """Append the rows one engine call returned (asked with ``routed_experts_start_len = start_len``,
    ``seqlen`` = its prompt plus output tokens) to ``sample.rollout_routed_experts``."""
    import numpy as np

    if start_len != rows_held(sample):
        raise RoutedExpertsMissing(f"a call asked for routing from position {start_len} but the sample holds "
                                   f"{rows_held(sample)} rows")
    new = decode_routed_experts(meta, seqlen - 1 - start_len, shape)
    held = sample.rollout_routed_experts
    sample.rollout_routed_experts = new if held is None else np.concatenate([held, new], axis=0)


def decode_all_rows(meta: dict | None, shape: RoutingShape):
    """The routing of every position of a call asked with ``routed_experts_start_len`` 0, when the
    caller does not know the call's length (a hook's own router call): rows from the payload's size."""
    return decode_routed_experts(meta, None, shape)


def extend_routing(sample: Sample, routed) -> None:
    """Extend ``sample.rollout_routed_experts`` with the rows of ``routed`` (a call's routing of all its
    positions) past those the sample holds: each position keeps the first call that ran it."""
    import numpy as np

    held = rows_held(sample)
    if routed.shape[0] <= held:
        return
    new = routed[held:]
    sample.rollout_routed_experts = new if held == 0 else np.concatenate([sample.rollout_routed_experts, new], axis=0)


def check_covers_tokens(sample: Sample, shape: RoutingShape) -> None:
    """``RoutedExpertsMissing`` unless the sample holds one row per position but the last."""
    needed = len(sample.prompt_ids) + len(sample.response_ids) - 1
    routed = sample.rollout_routed_experts
    if routed is None:
        raise RoutedExpertsMissing("routing replay is on and a sample reached the rollout without routed experts "
                                   "(every engine call must go through args.engine.generate)")
    if tuple(routed.shape) != (needed, shape.num_layers, shape.top_k):
        tail = needed - int(routed.shape[0])
        why = (f"its last {tail} tokens were appended after its last engine call, so no engine routed them: end "
               "the episode with an engine call, or leave those tokens out") if tail > 0 else \
            "the tokens were changed after the engines routed them"
        raise RoutedExpertsMissing(f"a sample's routed experts have shape {tuple(routed.shape)}, its "
                                   f"{needed + 1} tokens need ({needed}, {shape.num_layers}, {shape.top_k}): {why}")


def to_jsonable(routed) -> list | None:
    """``--save-debug-rollout-data``: the array as nested lists."""
    return None if routed is None else routed.tolist()


def from_jsonable(value) -> Any:
    """``--load-debug-rollout-data``: nested lists back into an int32 array (None stays None)."""
    if value is None:
        return None
    import numpy as np

    array = np.asarray(value, dtype=np.int32)
    if array.ndim != 3:
        raise ValueError(f"rollout_routed_experts must be [positions, layers, top_k], got {array.ndim} dimensions")
    return array
