"""Answer scoring: the final answer of a response, its normalization, and matching it to a label.

Shared by the reward registry (:mod:`miles_disagg.rollout.rewards`, ``--rm-type math`` /
``deepscaler``) and miles' reward types (:mod:`miles_disagg.rollout.miles_rm_types`, ``boxed_<type>``).

* ``math``       - final answer from the last ``\\boxed{...}``, else the text after the
  last ``Answer:``, else after the last ``####``; 1.0 when it matches the label, else 0.0.
* ``deepscaler`` - only the text after the last ``</think>`` counts (a response that
  opened ``<think>`` and never closed it scores 0.0), and only a boxed answer counts.

Matching (:func:`answers_match`) is an exact match of the normalized strings
(:func:`normalize_answer`) or numeric equality within a relative tolerance of
``REL_TOL`` (integers, decimals, ``a/b``, ``\\frac{a}{b}``, percentages, comma thousands
separators). No computer algebra: ``\\sqrt{8}`` and ``2\\sqrt{2}`` do not match. This is
deliberate, so a reward never depends on which optional packages are installed.

Every function here is pure (no state), so safe to call from several threads at once.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

from miles_disagg.types import InvalidInput

REL_TOL = Fraction(1, 10**6)
ABS_TOL = Fraction(1, 10**9)
_MAX_NUMBER_CHARS = 64  # longer "numbers" are compared as strings (bounds Fraction's work)


# --------------------------------------------------------------------------- extraction


_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces kept), or ``None``.

    ``\\boxed 5`` (no braces) yields ``"5"``. An unterminated last box yields ``None``:
    a truncated final answer is no answer, earlier boxes do not stand in for it.
    """
    start, command = max((text.rfind(c), c) for c in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command):]
    if rest.startswith("{"):
        return _braced(rest)
    bare = re.match(r"\s+([^\s$}]+)", rest)
    return bare.group(1) if bare else None


def _braced(text: str) -> str | None:
    """``text`` starts with ``{``; the content up to its matching ``}``, or ``None`` if unbalanced."""
    depth = 0
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[1:i]
    return None


def _after_last(text: str, pattern: str) -> str | None:
    """The rest of the line after the last match of ``pattern``, or ``None``."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        return None
    line = text[matches[-1].end():].strip().split("\n", 1)[0].strip()
    return line or None


def extract_math_answer(response: str) -> str | None:
    """Final answer of a response: last box, else after ``Answer:``, else after ``####``."""
    boxed = last_boxed(response)
    if boxed is not None:
        return boxed
    answer = _after_last(response, r"(?i)answer\s*:")
    if answer is not None:
        return answer
    return _after_last(response, r"####")


def extract_deepscaler_answer(response: str) -> str | None:
    """The boxed answer after the last ``</think>``; ``None`` if thinking never closed."""
    if "</think>" in response:
        response = response.rsplit("</think>", 1)[1]
    elif "<think>" in response:
        return None
    return last_boxed(response)


# --------------------------------------------------------------------------- normalization


_SPACING = re.compile(r"\\[!,;:]|\\q?quad(?![a-zA-Z])|~")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![a-zA-Z])|\\degree(?![a-zA-Z])|°")
_UNWRAP = re.compile(r"\\(?:textbf|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}")
_TEXT = re.compile(r"\\(?:text|mbox|textrm)\s*\{([^{}]*)\}")
_UNIT_AFTER_TEXT = re.compile(r"\\(?:text|mbox|textrm)\s*\{[^{}]*\}(?:\^\{?\d\}?)?")
_LEADING_ASSIGN = re.compile(r"^(?:[a-zA-Z]|\\[a-zA-Z]+)\s*=(?!=)\s*")
_NUMBER_THEN_UNIT = re.compile(r"^([+-]?[\d.,]+%?)\s+[a-zA-Z]+(?:\^\{?[23]\}?)?$")


def normalize_answer(answer: str) -> str:
    """Canonical string form of an answer, for exact comparison.

    Drops ``$``, ``\\left``/``\\right``, spacing commands, degree marks, ``\\text{...}``
    units (a whole-answer ``\\text{X}`` becomes ``X``), one unit word after a number
    (``18 dollars``), a leading ``x =``, a trailing ``.``, all whitespace and one pair of
    enclosing braces;
    ``\\dfrac``/``\\tfrac`` become ``\\frac``; ``\\frac12`` and ``\\sqrt2`` get braces.
    """
    s = answer.strip().replace("\\$", "").replace("$", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",").replace("\\%", "%")
    s = _SPACING.sub(" ", _LEFT_RIGHT.sub("", s))
    s = _DEGREES.sub("", s)
    s = _UNWRAP.sub(r"\1", s)
    s = _strip_text_units(s)
    s = _LEADING_ASSIGN.sub("", s.strip())
    s = _NUMBER_THEN_UNIT.sub(r"\1", s.strip())
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _brace_shorthands(s)
    if s.startswith("{") and _braced(s) == s[1:-1]:
        s = s[1:-1]
    return s


def _strip_text_units(s: str) -> str:
    """Whole-answer ``\\text{X}`` -> ``X``; otherwise ``\\text{...}`` after a value is a unit."""
    whole = _TEXT.fullmatch(s.strip())
    if whole:
        return whole.group(1)
    stripped = _UNIT_AFTER_TEXT.sub("", s)
    return stripped if stripped.strip() else _TEXT.sub(r"\1", s)


def _brace_shorthands(s: str) -> str:
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac(\d)\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac(\{[^{}]*\})(\d)", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)


# --------------------------------------------------------------------------- numbers


_PLAIN = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d{1,3})?")
_THOUSANDS = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_SLASH = re.compile(r"([+-]?[\d.]+)/([+-]?[\d.]+)")
_FRAC = re.compile(r"([+-]?)\\frac\{([^{}]+)\}\{([^{}]+)\}")


def numeric_values(normalized: str) -> list[Fraction]:
    """Exact values a normalized answer may denote; empty when it is not a number.

    A percentage denotes both ``p`` and ``p/100`` (``50%`` matches ``50`` and ``0.5``).
    """
    s = normalized
    if not s or len(s) > _MAX_NUMBER_CHARS:
        return []
    if s.endswith("%"):
        value = _plain_or_fraction(s[:-1])
        return [] if value is None else [value, value / 100]
    value = _plain_or_fraction(s)
    return [] if value is None else [value]


def _plain_or_fraction(s: str) -> Fraction | None:
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    if _PLAIN.fullmatch(s):
        return Fraction(s)
    for pattern in (_SLASH, _FRAC):
        match = pattern.fullmatch(s)
        if match:
            return _ratio(*match.groups()) if pattern is _FRAC else _ratio("", *match.groups())
    return None


def _ratio(sign: str, numerator: str, denominator: str) -> Fraction | None:
    if not (_PLAIN.fullmatch(numerator) and _PLAIN.fullmatch(denominator)):
        return None
    den = Fraction(denominator)
    if den == 0:
        return None
    value = Fraction(numerator) / den
    return -value if sign == "-" else value


def _close(a: Fraction, b: Fraction) -> bool:
    return abs(a - b) <= max(REL_TOL * max(abs(a), abs(b)), ABS_TOL)


def answers_match(predicted: str, label: str) -> bool:
    """Normalized strings equal, or both numeric and equal within ``REL_TOL``."""
    pred, gold = normalize_answer(predicted), normalize_answer(label)
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    return any(_close(a, b) for a in numeric_values(pred) for b in numeric_values(gold))


def label_answers(label: Any) -> list[str]:
    """The accepted answers a label stands for (a list/tuple label accepts any of its items).

    A string label holding ``\\boxed{...}`` or ``#### X`` is reduced to that answer.
    ``InvalidInput`` for a missing label or one that is neither text nor a number.
    """
    if isinstance(label, (list, tuple)) and label:
        return [answer for item in label for answer in label_answers(item)]
    if isinstance(label, bool) or label is None or not isinstance(label, (str, int, float, Fraction)):
        raise InvalidInput(f"a math reward needs a text or numeric label (or a list of them), got {label!r}")
    if not isinstance(label, str):
        return [str(label)]
    boxed = last_boxed(label)
    if boxed is not None:
        return [boxed]
    return [_after_last(label, r"####") or label]


def _score(extracted: str | None, label: Any) -> float:
    gold = label_answers(label)
    if extracted is None:
        return 0.0
    return 1.0 if any(answers_match(extracted, answer) for answer in gold) else 0.0


def math_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """``--rm-type math``: 1.0 if the final answer matches the label, else 0.0."""
    return _score(extract_math_answer(response), label)


def deepscaler_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """``--rm-type deepscaler``: 1.0 if the boxed answer after ``</think>`` matches, else 0.0."""
    return _score(extract_deepscaler_answer(response), label)
