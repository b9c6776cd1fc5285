"""SGLang's routed-experts wire: how an engine's answer carries the experts each token was routed to.

A ``/generate`` body with ``"return_routed_experts": true`` and ``"routed_experts_start_len": S``
is answered with ``meta_info["routed_experts"]``: the base64 (standard alphabet, padded, no
newlines) of a little-endian int32 array ``[seqlen - 1 - S, num_hidden_layers, num_experts_per_tok]``
in C order, row ``p`` the experts of the token at absolute position ``S + p`` (``seqlen``: the
call's prompt plus output tokens; the last token is never fed, so it has no row); layers without
experts hold -1. That is SGLang 0.5.23's format; the built-in engine encodes it
(:func:`encode_routed_experts`) and the rollout decodes it (:func:`decode_routed_experts`).
"""

from __future__ import annotations

import base64
import binascii
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

ROUTED_EXPERTS_FIELD = "routed_experts"
"""``meta_info`` key of the answer (SGLang's)."""
START_LEN_FIELD = "routed_experts_start_len"
"""The request's (and this project's answer's) first position the rows start at."""
WIRE_DTYPE = "<i4"


class RoutingWireError(ValueError):
    """A ``meta_info["routed_experts"]`` payload that is not the wire format (not a string, not
    base64, or not the size the rows need); the message says which."""


def encode_routed_experts(rows: Any, start_len: int = 0) -> str:
    """The payload of ``rows[start_len:]``: ``rows`` is an integer array-like ``[positions, layers,
    top_k]`` holding every position's routing, ``start_len`` the request's
    ``routed_experts_start_len`` (``ValueError`` when negative)."""
    import numpy as np

    if start_len < 0:
        raise ValueError(f"{START_LEN_FIELD} must be >= 0, got {start_len}")
    array = np.ascontiguousarray(np.asarray(rows)[start_len:].astype(WIRE_DTYPE, copy=False))
    return base64.b64encode(array.tobytes()).decode("ascii")


def decode_routed_experts(encoded: object, layers: int, top_k: int, rows: int | None = None) -> np.ndarray:
    """A payload as a writable int32 ``[rows, layers, top_k]`` array (base64-decoded once).

    ``rows``: the positions the caller expects (``seqlen - 1 - start_len``); ``None``: as many as
    the payload holds. :class:`RoutingWireError` for a payload that is not a string, not valid
    base64, or whose size is not ``rows`` (or a whole number of) rows of ``layers x top_k`` int32.
    """
    import numpy as np

    if layers < 1 or top_k < 1:
        raise ValueError(f"a routing row needs layers >= 1 and top-k >= 1, got {layers} x {top_k}")
    if not isinstance(encoded, str):
        raise RoutingWireError(f"meta_info[{ROUTED_EXPERTS_FIELD!r}] must be a base64 string, got {type(encoded).__name__}")
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise RoutingWireError(f"meta_info[{ROUTED_EXPERTS_FIELD!r}] is not valid base64: {exc}") from None
    row_bytes = layers * top_k * 4
    if rows is None and len(raw) % row_bytes:
        raise RoutingWireError(f"meta_info[{ROUTED_EXPERTS_FIELD!r}] holds {len(raw)} bytes, not a whole number of rows of "
                               f"{layers} layers x top-{top_k} int32 ({row_bytes} bytes each)")
    rows = len(raw) // row_bytes if rows is None else rows
    if len(raw) != rows * row_bytes:
        raise RoutingWireError(f"meta_info[{ROUTED_EXPERTS_FIELD!r}] holds {len(raw)} bytes; {rows} positions x {layers} layers x "
                               f"top-{top_k} int32 need {rows * row_bytes}")
    return np.frombuffer(raw, dtype=WIRE_DTYPE).astype(np.int32).reshape(rows, layers, top_k)
