"""Rule-based rewards and the reward registry (``--rm-type``, ``--custom-rm-path``).

A reward function is called as ``fn(prompt, response, label, metadata) -> float``
(:data:`RewardFn`): the rendered prompt text, the generated text, the dataset label and
the prompt's metadata dict. It is synchronous and must be safe to call from several
threads at once (the rule rewards here keep no state).

Built-in names:

* ``math``       - final answer from the last ``\\boxed{...}``, else the text after the
  last ``Answer:``, else after the last ``####``; 1.0 when it matches the label, else 0.0.
* ``deepscaler`` - only the text after the last ``</think>`` counts (a response that
  opened ``<think>`` and never closed it scores 0.0), and only a boxed answer counts.

Matching (:func:`answers_match`) is an exact match of the normalized strings
(:func:`normalize_answer`) or numeric equality within a relative tolerance of
``REL_TOL`` (integers, decimals, ``a/b``, ``\\frac{a}{b}``, percentages, comma thousands
separators). No computer algebra: ``\\sqrt{8}`` and ``2\\sqrt{2}`` do not match. This is
deliberate, so a reward never depends on which optional packages are installed.

Tasks register their own reward under their task name with :func:`register_reward`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
import re
from fractions import Fraction
from typing import Any, Callable

from miles_disagg.types import ConfigError, FailRun, InvalidInput, MilesDisaggError

RewardFn = Callable[[str, str, Any, dict], float]

RM_TYPE_FLAG = "--rm-type"
CUSTOM_RM_FLAG = "--custom-rm-path"
REL_TOL = Fraction(1, 10**6)
ABS_TOL = Fraction(1, 10**9)
_MAX_NUMBER_CHARS = 64  # longer "numbers" are compared as strings (bounds Fraction's work)


class RewardError(FailRun):
    """A reward function returned something that is not a finite number."""


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


# --------------------------------------------------------------------------- registry


_REGISTRY: dict[str, RewardFn] = {"math": math_reward, "deepscaler": deepscaler_reward}
_PARAMETERS = ("prompt", "response", "label", "metadata")


def register_reward(name: str, fn: RewardFn) -> None:
    """Make ``fn`` available as ``--rm-type name``.

    Registering the same function twice is a no-op (modules may be imported twice);
    a different function under a taken name raises ``InvalidInput``.
    """
    if not name or not isinstance(name, str):
        raise InvalidInput(f"a reward name must be a non-empty string, got {name!r}")
    _check_signature(fn, f"register_reward({name!r})", flags=())
    existing = _REGISTRY.get(name)
    if existing is not None and existing is not fn:
        raise InvalidInput(f"reward {name!r} is already registered to {getattr(existing, '__qualname__', existing)}")
    _REGISTRY[name] = fn


def known_rewards() -> list[str]:
    """Registered reward names, sorted."""
    return sorted(_REGISTRY)


def get_reward_fn(rm_type: str | None, custom_rm_path: str | None) -> RewardFn:
    """The reward for a run; ``--custom-rm-path`` takes precedence over ``--rm-type``.

    A custom ``async def`` is miles' form ``reward_func(args, sample, **kwargs)`` and is returned
    as is (``sample_rewards.SampleReward`` calls it); a synchronous one is this project's form.

    Fails early with ``ConfigError`` naming the flag: neither given, an unknown
    ``rm_type``, or a custom path that is malformed, cannot be imported, or does not
    accept ``(prompt, response, label, metadata)``. The returned function raises
    ``RewardError`` if the underlying one returns a non-number, NaN or infinity.
    """
    if custom_rm_path:
        fn = _load_custom(custom_rm_path)
        return fn if inspect.iscoroutinefunction(fn) else _checked(fn, custom_rm_path)
    if not rm_type:
        raise ConfigError(f"no reward: give {RM_TYPE_FLAG} (one of {known_rewards()}) or {CUSTOM_RM_FLAG} "
                          "module:function", flags=(RM_TYPE_FLAG, CUSTOM_RM_FLAG))
    from miles_disagg.rollout.miles_rm_types import REFUSED_RM_TYPES, is_miles_rm_type, rm_type_reward

    if is_miles_rm_type(rm_type):  # miles' rm_hub types: miles' async form (rollout/miles_rm_types.py)
        base = rm_type.removeprefix("boxed_")
        if base in REFUSED_RM_TYPES:
            raise ConfigError(f"{RM_TYPE_FLAG} {base} is a miles reward that does not apply here: "
                              f"{REFUSED_RM_TYPES[base]}", (RM_TYPE_FLAG,))
        return rm_type_reward(rm_type)
    if rm_type not in _REGISTRY:
        raise ConfigError(f"{RM_TYPE_FLAG} {rm_type!r} is unknown; known: {known_rewards()} and miles' "
                          "dapo, f1, gpqa, random, boxed_<type>", flags=(RM_TYPE_FLAG,))
    return _checked(_REGISTRY[rm_type], rm_type)


def _load_custom(spec: str) -> RewardFn:
    """Import ``module:function`` (or miles' dotted ``package.module.function``)."""
    from miles_disagg.rollout.miles_compat import install_miles_imports

    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr.isidentifier():
        raise ConfigError(f"{CUSTOM_RM_FLAG} {spec!r} is not of the form module:function", flags=(CUSTOM_RM_FLAG,))
    install_miles_imports()  # user code may import miles' paths
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{CUSTOM_RM_FLAG} {spec!r}: cannot import module {module_name!r} ({exc})",
                          flags=(CUSTOM_RM_FLAG,)) from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{CUSTOM_RM_FLAG} {spec!r}: module {module_name!r} has no attribute {attr!r}",
                          flags=(CUSTOM_RM_FLAG,))
    if inspect.iscoroutinefunction(fn):  # miles' form: async def reward_func(args, sample, **kwargs)
        _check_miles_signature(fn, f"{CUSTOM_RM_FLAG} {spec!r}")
    else:
        _check_signature(fn, f"{CUSTOM_RM_FLAG} {spec!r}", flags=(CUSTOM_RM_FLAG,))
    return fn


def _check_miles_signature(fn: Any, what: str) -> None:
    try:
        inspect.signature(fn).bind("args", "sample")
    except TypeError:
        raise ConfigError(f"{what}: an async reward has miles' form async def reward_func(args, sample, **kwargs) "
                          f"(or (args, samples) with --group-rm); its signature is {inspect.signature(fn)}",
                          flags=(CUSTOM_RM_FLAG,)) from None


def _check_signature(fn: Any, what: str, flags: tuple[str, ...]) -> None:
    """A reward is a plain synchronous callable accepting the four positional arguments.

    Problems raise ``ConfigError`` naming ``flags`` when given (a flag's value), else
    ``InvalidInput`` (a programming error in a task's registration).
    """
    def refuse(message: str) -> MilesDisaggError:
        return ConfigError(f"{what}: {message}", flags=flags) if flags else InvalidInput(f"{what}: {message}")

    if not callable(fn):
        raise refuse(f"{fn!r} is not callable")
    if inspect.iscoroutinefunction(fn):
        raise refuse("must be a synchronous function, got a coroutine function")
    try:
        inspect.signature(fn).bind(*_PARAMETERS)
    except TypeError:
        raise refuse(f"must accept ({', '.join(_PARAMETERS)}); its signature is {inspect.signature(fn)} (miles' "
                     "form reward_func(args, sample, **kwargs) is an async def)") from None
    except ValueError:
        pass  # builtins without an inspectable signature


def _checked(fn: RewardFn, name: str) -> RewardFn:
    """Wrap ``fn`` so a non-numeric or non-finite result fails loudly instead of training on it."""

    def reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
        value = fn(prompt, response, label, metadata)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value!r}; expected a finite number")
        return float(value)

    reward.__name__ = reward.__qualname__ = f"checked_{getattr(fn, '__name__', 'reward')}"
    reward.__wrapped__ = fn  # type: ignore[attr-defined]
    return reward
