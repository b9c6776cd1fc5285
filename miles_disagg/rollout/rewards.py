"""The reward registry (``--rm-type``, ``--custom-rm-path``).

A reward function is called as ``fn(prompt, response, label, metadata) -> float``
(:data:`RewardFn`): the rendered prompt text, the generated text, the dataset label and
the prompt's metadata dict. It is synchronous and must be safe to call from several
threads at once (the rule rewards keep no state).

Built-in names: ``math`` and ``deepscaler``, the rule rewards of
:mod:`miles_disagg.rollout.answer_scoring`; miles' network-free types (``dapo``, ``f1``, ``gpqa``,
``random``, ``boxed_<type>``) come from :mod:`miles_disagg.rollout.miles_rm_types`.

Tasks register their own reward under their task name with :func:`register_reward`.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from typing import Any, Callable

from miles_disagg.rollout.answer_scoring import deepscaler_reward, math_reward
from miles_disagg.rollout.miles_rm_types import REFUSED_RM_TYPES, is_miles_rm_type, rm_type_reward
from miles_disagg.types import ConfigError, FailRun, InvalidInput, MilesDisaggError

RewardFn = Callable[[str, str, Any, dict], float]

RM_TYPE_FLAG = "--rm-type"
CUSTOM_RM_FLAG = "--custom-rm-path"


class RewardError(FailRun):
    """A reward function returned something that is not a finite number."""


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
