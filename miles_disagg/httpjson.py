"""JSON over HTTP, shared by the engine, the agent and the router: request bodies and typed errors.

Errors map to statuses by what the caller must do: bad input or a refused operation 400,
retry later 409, replace the replica 503, anything else 500 (logged with its traceback).
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any, Mapping

from miles_disagg.types import FailRun, InvalidInput, MilesDisaggError, ReplaceReplica, Retryable

log = logging.getLogger(__name__)


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object; ``InvalidInput`` for anything else."""
    if not body:
        return {}
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidInput(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(obj).__name__}")
    return obj


def status_for(exc: BaseException, special: Mapping[type, int] | None = None) -> int:
    for kind, status in (special or {}).items():
        if isinstance(exc, kind):
            return status
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
