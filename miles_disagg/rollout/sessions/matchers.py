"""When a message a client replays counts as the one the session stored (``--session-message-matcher``).

miles' selectors, with miles' meanings. Each matcher is ``matches(stored, replayed) -> bool`` over two
OpenAI chat messages and decides only whether the message at one position is the same one; the
trajectory tree (:mod:`.tree`) attaches a request to the deepest node whose messages all match, and on
a match the stored messages and token ids stay authoritative.

* ``strict`` (default): the fields a chat template reads are equal: ``role``, ``content``,
  ``reasoning_content`` and ``tool_calls`` (``None``, ``""`` and ``[]`` count as the same empty value;
  a tool call's ``index``, which only the wire carries, is ignored).
* ``loose_tool_call``: what ``strict`` accepts, and tool calls whose ``function.arguments`` are the same
  JSON object written differently (spacing, key order; ``None``/``""``/``"{}"`` all the empty object).
  Call ids, types, function names, order and ``reasoning_content`` must still match; an assistant
  message with tool calls and blank content matches one with none.
* ``role_content_only``: only ``role`` and ``content`` (high risk: different tool-call histories
  collapse into one lineage, and call ids are not reconciled).
* a dotted import path ``pkg.module.function``: a trusted synchronous matcher of the same signature; it
  must return a ``bool`` (anything else, or an exception, is :class:`MatcherFailed`).
"""

from __future__ import annotations

import json
from typing import Any, Callable

from miles_disagg.types import MilesDisaggError

Matcher = Callable[[dict[str, Any], dict[str, Any]], bool]
TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls")
_NOT_AN_OBJECT = object()


class MatcherFailed(MilesDisaggError):
    """A configured ``--session-message-matcher`` raised or returned something other than a bool (a
    configuration fault: never taken as a match or a mismatch)."""


def _empty(value: Any) -> Any:
    return None if value is None or value == "" or value == [] else value


def _calls(value: Any) -> Any:
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in call.items() if k != "index"} if isinstance(call, dict) else call for call in value]


def strict(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    for key in TEMPLATE_KEYS:
        mine, theirs = _empty(stored.get(key)), _empty(replayed.get(key))
        if key == "tool_calls":
            mine, theirs = _calls(mine), _calls(theirs)
        if mine != theirs:
            return False
    return True


def _json_object(value: Any) -> Any:
    """``arguments`` as a comparable JSON object (``_NOT_AN_OBJECT`` when it is not one)."""
    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value, parse_constant=_no_constant)
        except (ValueError, RecursionError):
            return _NOT_AN_OBJECT
    return value if type(value) is dict else _NOT_AN_OBJECT


def _no_constant(raw: str):
    raise ValueError(f"non-standard JSON constant {raw}")


def _same_call(stored: Any, replayed: Any) -> bool:
    if not (isinstance(stored, dict) and isinstance(replayed, dict)):
        return stored == replayed
    mine, theirs = _calls([stored])[0], _calls([replayed])[0]
    if mine.keys() != theirs.keys():
        return False
    for key in mine:
        if key != "function":
            if mine[key] != theirs[key]:
                return False
            continue
        f, g = mine[key], theirs[key]
        if not (isinstance(f, dict) and isinstance(g, dict)) or f.keys() != g.keys():
            return f == g
        for name in f:
            if name == "arguments":
                a, b = _json_object(f[name]), _json_object(g[name])
                same = f[name] == g[name] if _NOT_AN_OBJECT in (a, b) else _tagged(a) == _tagged(b)
            else:
                same = f[name] == g[name]
            if not same:
                return False
    return True


def _tagged(value: Any) -> Any:
    """A JSON value with its type kept apart under ``==`` (``True`` vs ``1``, ``"1"`` vs ``1``), keys sorted."""
    if isinstance(value, dict):
        return ("object", tuple(sorted((k, _tagged(v)) for k, v in value.items())))
    if isinstance(value, list):
        return ("array", tuple(_tagged(v) for v in value))
    return (type(value).__name__ if not isinstance(value, (int, float)) or isinstance(value, bool) else "number",
            value)


def loose_tool_call(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    if strict(stored, replayed):
        return True
    with_calls = stored.get("role") == replayed.get("role") == "assistant" and stored.get("tool_calls") \
        and replayed.get("tool_calls")
    for key in ("role", "content", "reasoning_content"):
        mine, theirs = _empty(stored.get(key)), _empty(replayed.get(key))
        if key == "content" and with_calls:
            mine = None if isinstance(mine, str) and not mine.strip() else mine
            theirs = None if isinstance(theirs, str) and not theirs.strip() else theirs
        if mine != theirs:
            return False
    mine, theirs = _empty(stored.get("tool_calls")), _empty(replayed.get("tool_calls"))
    if not (isinstance(mine, list) and isinstance(theirs, list)):
        return mine == theirs
    return len(mine) == len(theirs) and all(_same_call(a, b) for a, b in zip(mine, theirs))


def role_content_only(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
    return all(_empty(stored.get(key)) == _empty(replayed.get(key)) for key in ("role", "content"))


BUILT_IN: dict[str, Matcher] = {"strict": strict, "loose_tool_call": loose_tool_call,
                                "role_content_only": role_content_only}


def checked(matcher: Matcher, name: str) -> Matcher:
    """``matcher`` held to its contract: a bool, no exception (else :class:`MatcherFailed`)."""

    def matches(stored: dict[str, Any], replayed: dict[str, Any]) -> bool:
        try:
            result = matcher(stored, replayed)
        except Exception as exc:
            raise MatcherFailed(f"--session-message-matcher {name} raised {type(exc).__name__}: {exc}") from None
        if type(result) is not bool:
            raise MatcherFailed(f"--session-message-matcher {name} returned {type(result).__name__}, not a bool")
        return result

    return matches
