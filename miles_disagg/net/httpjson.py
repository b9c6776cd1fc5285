"""JSON over HTTP, shared by the engine, the agent, the router and the gateway: request bodies and typed errors.

A request body is a pydantic model (or a dataclass) validated by :func:`parse_body`
in pydantic's strict JSON mode; a body that does not validate is ``InvalidInput`` with
one message naming the field (``sampling_params[0].top_k must be >= -1, got -2``).
Errors map to statuses by what the caller must do: bad input or a refused operation 400
(403 for ``Forbidden``: a path outside the server's roots, an unverified version label),
retry later 409, replace the replica 503, anything else 500 (logged with its traceback).
"""

from __future__ import annotations

import functools
import json
import logging
import traceback
from typing import Any, Mapping, TypeVar

from miles_disagg.types import FailRun, Forbidden, InvalidInput, MilesDisaggError, ReplaceReplica, Retryable

log = logging.getLogger(__name__)

T = TypeVar("T")

# pydantic error type -> what the field must be
_PREDICATES = {
    "missing": "is required", "int_type": "must be an integer", "float_type": "must be a number",
    "bool_type": "must be true or false", "string_type": "must be a string", "list_type": "must be a list",
    "tuple_type": "must be a list", "dict_type": "must be an object", "model_type": "must be an object",
    "dataclass_type": "must be an object", "string_too_short": "must be a non-empty string",
    "too_short": "must not be empty",
}
_BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}


OFF_LOOP_BYTES = 64 * 1024  # bodies bigger than this are parsed and encoded in a worker thread


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object; ``InvalidInput`` for anything else.

    pydantic-core's parser: invalid UTF-8, lone surrogates (``"\\ud800"``) and nesting deeper
    than its recursion limit are ``InvalidInput`` too, never a ``RecursionError`` or a string
    no tokenizer can encode."""
    import pydantic_core

    if not body:
        return {}
    try:
        obj = pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


async def parse_json_async(body: bytes) -> dict:
    """:func:`parse_json`, in a worker thread for big bodies, so the event loop keeps answering."""
    if len(body) <= OFF_LOOP_BYTES:
        return parse_json(body)
    import asyncio

    return await asyncio.to_thread(parse_json, body)


async def dumps_async(obj: Any, size_hint: int) -> bytes:
    """``json.dumps(obj).encode()``, in a worker thread when ``size_hint`` (the body it came from) is big."""
    if size_hint <= OFF_LOOP_BYTES:
        return json.dumps(obj).encode()
    import asyncio

    return await asyncio.to_thread(lambda: json.dumps(obj).encode())


def parse_body(kind: type[T], body: bytes | Any, context: dict | None = None) -> T:
    """``body`` (raw bytes, or a value already decoded from JSON) validated into ``kind``; an empty
    body is ``{}``. ``InvalidInput`` naming the field for anything malformed; nothing is half-parsed.
    ``context`` reaches the model's validators (e.g. a bound known only to the server)."""
    from pydantic import ValidationError

    try:
        raw = (bytes(body) or b"{}") if isinstance(body, (bytes, bytearray)) else json.dumps(body)
        return _adapter(kind).validate_json(raw, strict=True, context=context)
    except ValidationError as exc:
        raise InvalidInput(validation_message(exc)) from None
    except (RecursionError, ValueError) as exc:  # a decoded value too deep or not JSON-encodable
        raise InvalidInput(f"request body is not valid JSON: {type(exc).__name__}: {exc}") from None


@functools.lru_cache(maxsize=None)
def _adapter(kind: type) -> Any:
    from pydantic import TypeAdapter

    return TypeAdapter(kind)


def validation_message(exc: Any) -> str:
    """One line from a pydantic ``ValidationError``: its first problem, naming the field."""
    errors = exc.errors(include_url=False)
    error, more = errors[0], len(errors) - 1
    kind, ctx, where, value = error["type"], error.get("ctx") or {}, _location(error["loc"]), error.get("input")
    if kind == "json_invalid":
        message = f"request body is not valid JSON: {ctx.get('error')}"
    elif not where and kind in ("model_type", "dataclass_type"):
        message = f"request body must be a JSON object, got {type(value).__name__}"
    elif kind in ("value_error", "assertion_error"):  # our own validators: the message says it all
        message = f"{where}: {ctx.get('error')}" if where else str(ctx.get("error"))
    elif kind == "missing":
        message = f"{where} is required"
    else:
        message = f"{where} {_predicate(kind, ctx, error['msg'])}, got {value!r}"
    return message + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def _predicate(kind: str, ctx: dict, fallback: str) -> str:
    if kind in ("enum", "literal_error"):
        return f"must be one of {ctx['expected']}"
    if kind in _BOUNDS:
        bound = next(iter(v for k, v in ctx.items() if k in ("ge", "gt", "le", "lt")))
        return f"must be {_BOUNDS[kind]} {bound}"
    return _PREDICATES.get(kind, f"is invalid ({fallback})")


def _location(loc: tuple) -> str:
    """``("sampling_params", 0, "top_k")`` -> ``sampling_params[0].top_k``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def status_for(exc: BaseException, special: Mapping[type, int] | None = None) -> int:
    for kind, status in (special or {}).items():
        if isinstance(exc, kind):
            return status
    if isinstance(exc, Forbidden):
        return 403
    if isinstance(exc, (InvalidInput, FailRun)):
        return 400
    if isinstance(exc, Retryable):
        return 409
    if isinstance(exc, ReplaceReplica):
        return 503
    return 500


def error_json(exc: BaseException, status: int) -> dict[str, Any]:
    """``{"error": {message, type, code, retryable}}``; a 500 is logged with its traceback."""
    message = str(exc) if isinstance(exc, MilesDisaggError) else f"{type(exc).__name__}: {exc}"
    if status == 500:
        log.error("internal error:\n%s", "".join(traceback.format_exception(exc)))
    return {"error": {"message": message, "type": type(exc).__name__, "code": status,
                      "retryable": isinstance(exc, Retryable)}}
