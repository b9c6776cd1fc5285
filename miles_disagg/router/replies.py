"""What the router sends and answers, byte for byte: the body a worker gets (:func:`payload_for`), the
JSON codec of answers (:func:`encode`, :func:`json_or_none`), the per-item metadata an answer carries
(:func:`metas_of`), the JSON error answer (:func:`error_response`) and the routing-overhead percentiles of
``/metrics``. Pure functions over bodies; :class:`~miles_disagg.router.proxy.Router` owns the state."""

from __future__ import annotations

import asyncio
import collections
import json
from typing import Any

import pydantic_core
from fastapi.responses import JSONResponse

from miles_disagg.net.httpjson import OFF_LOOP_BYTES
from miles_disagg.net.pooled_http import Reply
from miles_disagg.router.affinity import version_extra_key
from miles_disagg.router.policy import pinned_body, version_served
from miles_disagg.router.registry import Worker
from miles_disagg.types import Retryable, VersionConstraint


def percentiles_ms(values_s: collections.deque) -> dict[str, float | int | None]:
    """p50/p99/max in milliseconds of the router's own time per request (its time minus the workers')."""
    ordered = sorted(values_s)
    if not ordered:
        return {"count": 0, "p50": None, "p99": None, "max": None}
    at = lambda q: round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 3)  # noqa: E731
    return {"count": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1] * 1e3, 3)}


def payload_for(worker: Worker, payload: bytes, constraint: VersionConstraint, keyed_body: dict | None,
                 exact_body: dict | None) -> bytes:
    """What ``worker`` gets: ``payload``, or the body re-encoded with the ``lora_path`` of the older
    resident version it is pinned to (:func:`~miles_disagg.router.policy.pinned_body`) and a session's
    cache namespace of the version it runs on (``keyed_body``)."""
    pinned = pinned_body(exact_body, worker, constraint) if exact_body is not None else None
    if keyed_body is not None:
        return encode({**(pinned or keyed_body), "extra_key": version_extra_key(version_served(worker, constraint))})
    return payload if pinned is None else encode(pinned)


def json_or_none(response: Reply) -> Any:
    try:
        return pydantic_core.from_json(response.content)
    except ValueError:
        return None


def encode(obj: Any) -> bytes:
    """``obj`` as JSON (pydantic-core's encoder: a fifth of ``json.dumps``' time on a generation answer; the
    standard one for what it refuses, e.g. lone surrogates)."""
    try:
        return pydantic_core.to_json(obj)
    except ValueError:
        return json.dumps(obj).encode()


async def encode_async(obj: Any, size_hint: int) -> bytes:
    """:func:`encode`, in a worker thread when ``size_hint`` (the body it came from) is big."""
    if size_hint <= OFF_LOOP_BYTES:
        return encode(obj)
    return await asyncio.to_thread(encode, obj)


def metas_of(obj: Any, key: str) -> list[dict]:
    """The per-item metadata dicts of a response (a batched ``/generate`` answers a list)."""
    metas = []
    for item in obj if isinstance(obj, list) else [obj]:
        if isinstance(item, dict):
            if not isinstance(item.get(key), dict):
                item[key] = {}
            metas.append(item[key])
    return metas


def error_response(status: int, exc: BaseException, *, type_name: str | None = None,
                   headers: dict | None = None, message: str | None = None, **extra: Any) -> JSONResponse:
    """The router's JSON error answer: ``{"type", "retryable", "message", **extra}`` with ``status``
    (``type``: ``type_name`` or the exception's class name; ``retryable``: whether it is ``Retryable``)."""
    body = {"type": type_name or type(exc).__name__, "retryable": isinstance(exc, Retryable),
            "message": message or str(exc), **extra}
    return JSONResponse(body, status_code=status, headers=headers)

