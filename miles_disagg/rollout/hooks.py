"""User functions plugged into the rollout by path, with miles' flags and signatures.

A path is miles' dotted form (``my_pkg.my_module.my_function``) or ours
(``my_pkg.my_module:my_function``). Every hook is imported and its signature checked when the
run starts (:func:`load_rollout_hooks`), so a typo, a missing module or a wrong signature stops
the run before anything is launched, with a ``ConfigError`` naming the flag.

============================================  ==================================================================
flag                                          called as
============================================  ==================================================================
``--custom-generate-function-path``           ``async fn(args, sample, sampling_params) -> Sample``
``--rollout-function-path``                   ``async fn(args, rollout_id, data_source, evaluation=False)``
``--eval-function-path``                      ``async fn(args, rollout_id, data_source, evaluation=True)``
``--dynamic-sampling-filter-path``            ``fn(args, samples, **kwargs) -> FilterOutput | bool``
``--buffer-filter-path``                      ``fn(args, rollout_id, buffer, num_samples) -> list[list[Sample]]``
``--custom-reward-post-process-path``         ``fn(args, samples) -> (raw_rewards, rewards)``
============================================  ==================================================================

``--rollout-function-path`` and ``--eval-function-path`` also take miles' class form (a class
constructed with ``RolloutFnConstructorInput(args, data_source)`` and called with
``RolloutFnTrainInput`` / ``RolloutFnEvalInput``; see :class:`ClassRolloutFunction`).

``args`` is a :class:`~miles_disagg.rollout.hook_args.RolloutArgs` (what a hook needs, under
miles' names), not the run's whole configuration.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from miles_disagg.types import ConfigError


@dataclass(frozen=True)
class HookKind:
    """One extension point: its flag, how it is called, and whether it must be ``async def``."""

    flag: str
    call: tuple[str, ...]
    """Positional parameters it is called with (``args`` first)."""
    is_async: bool
    shown: str
    """The signature as the documentation shows it."""
    keywords: tuple[str, ...] = ()
    """Keyword arguments it must also accept."""


CUSTOM_GENERATE = HookKind("--custom-generate-function-path", ("args", "sample", "sampling_params"), True,
                           "async def generate(args, sample, sampling_params) -> Sample")
ROLLOUT_FUNCTION = HookKind("--rollout-function-path", ("args", "rollout_id", "data_source"), True,
                            "async def generate_rollout(args, rollout_id, data_source, evaluation=False)",
                            keywords=("evaluation",))
EVAL_FUNCTION = HookKind("--eval-function-path", ("args", "rollout_id", "data_source"), True,
                         "async def eval_rollout(args, rollout_id, data_source, evaluation=True)",
                         keywords=("evaluation",))
DYNAMIC_FILTER = HookKind("--dynamic-sampling-filter-path", ("args", "samples"), False,
                          "def filter(args, samples, **kwargs) -> FilterOutput | bool")
BUFFER_FILTER = HookKind("--buffer-filter-path", ("args", "rollout_id", "buffer", "num_samples"), False,
                         "def buffer_filter(args, rollout_id, buffer, num_samples) -> list[list[Sample]]")
REWARD_POST_PROCESS = HookKind("--custom-reward-post-process-path", ("args", "samples"), False,
                               "def post_process(args, samples) -> (raw_rewards, rewards)")


@dataclass(frozen=True)
class RolloutHooks:
    """The loaded hooks of one run; None where the flag is not given."""

    custom_generate: Callable | None = None
    rollout_function: Callable | None = None
    eval_function: Callable | None = None
    dynamic_filter: Callable | None = None
    buffer_filter: Callable | None = None
    reward_post_process: Callable | None = None


def load_rollout_hooks(config) -> RolloutHooks:
    """Import and check every hook named by a :class:`~miles_disagg.config.components.RolloutConfig`."""
    pairs = ((CUSTOM_GENERATE, config.custom_generate_function_path),
             (ROLLOUT_FUNCTION, config.rollout_function_path),
             (EVAL_FUNCTION, config.eval_function_path),
             (DYNAMIC_FILTER, config.dynamic_sampling_filter_path),
             (BUFFER_FILTER, config.buffer_filter_path),
             (REWARD_POST_PROCESS, config.custom_reward_post_process_path))
    loaded = [load_hook(kind, path) if path else None for kind, path in pairs]
    return RolloutHooks(*loaded)


def load_hook(kind: HookKind, spec: str) -> Callable:
    """Import ``spec`` and check it can be called the way ``kind`` calls it; ``ConfigError`` otherwise.
    A class given to a rollout or eval function flag is miles' class form (:class:`ClassRolloutFunction`)."""
    fn = import_path(spec, kind.flag)
    if inspect.isclass(fn) and kind in (ROLLOUT_FUNCTION, EVAL_FUNCTION):
        return ClassRolloutFunction(fn, kind, spec)
    check_signature(fn, kind, spec)
    return fn


class CurrentArgs:
    """The ``args`` a class-based function keeps from its construction: reads go to the args of the
    current call (an evaluation's args ask for exactly that evaluation's version)."""

    def __init__(self, args):
        self.current = args

    def __getattr__(self, name: str):
        if name == "current":
            raise AttributeError(name)
        return getattr(self.current, name)


class ClassRolloutFunction:
    """miles' class-based rollout (or eval) function behind the function form's call.

    Constructed once, at its first call, with ``RolloutFnConstructorInput(args, data_source)``; each
    call then passes ``RolloutFnTrainInput(rollout_id)`` (``RolloutFnEvalInput`` for evaluation) and
    awaits the result if it is awaitable. The ``args`` and data source it was constructed with keep
    their identity across calls; they show the current call's args and eval ``datasets``.
    """

    def __init__(self, cls: type, kind: HookKind, spec: str):
        what = f"{kind.flag} {spec!r}"
        for method, bound in ((cls.__init__, ("self", "input")), (getattr(cls, "__call__", None), ("self", "input"))):
            try:
                inspect.signature(method).bind(*bound)
            except (TypeError, ValueError):
                raise ConfigError(f"{what} is a class: miles' class form is constructed with "
                                  "RolloutFnConstructorInput and called with one RolloutFnTrainInput/"
                                  "RolloutFnEvalInput", (kind.flag,)) from None
        self._cls, self._kind, self._instance, self._source = cls, kind, None, None
        self.__name__ = getattr(cls, "__name__", "rollout_class")

    async def __call__(self, args, rollout_id: int, data_source, evaluation: bool = False):
        from miles_disagg.rollout.miles_compat.base_types import (
            RolloutFnConstructorInput, RolloutFnEvalInput, RolloutFnTrainInput)

        if self._instance is None:
            self._source, self._args = data_source, CurrentArgs(args)
            self._instance = self._cls(RolloutFnConstructorInput(args=self._args, data_source=data_source))
        else:
            self._args.current = args
            if hasattr(data_source, "datasets") and hasattr(self._source, "datasets"):
                self._source.datasets = data_source.datasets
        call_input = RolloutFnEvalInput(rollout_id=rollout_id) if evaluation else RolloutFnTrainInput(rollout_id)
        output = self._instance(call_input)
        return await output if inspect.isawaitable(output) else output


def import_path(spec: str, flag: str) -> Any:
    """``pkg.mod.fn`` or ``pkg.mod:fn`` -> the object; ``ConfigError`` naming ``flag`` if it does not resolve."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    if not module_name or not attr.isidentifier() or not all(p.isidentifier() for p in module_name.split(".")):
        raise ConfigError(f"{flag} {spec!r} must be a dotted path pkg.module.function (or pkg.module:function)",
                          (flag,))
    from miles_disagg.rollout.miles_compat import install_miles_imports

    install_miles_imports()  # user code may import miles' paths (served here when miles is not installed)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{flag} {spec!r}: cannot import module {module_name!r} ({exc})", (flag,)) from None
    if not hasattr(module, attr):
        raise ConfigError(f"{flag} {spec!r}: module {module_name!r} has no attribute {attr!r}", (flag,))
    return getattr(module, attr)


def check_signature(fn: Any, kind: HookKind, spec: str) -> None:
    what = f"{kind.flag} {spec!r}"
    if not callable(fn):
        raise ConfigError(f"{what} is not callable; expected {kind.shown}", (kind.flag,))
    if kind.is_async != inspect.iscoroutinefunction(fn):
        needed = "an async def function" if kind.is_async else "a plain (synchronous) function"
        raise ConfigError(f"{what} must be {needed}: {kind.shown}", (kind.flag,))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # no inspectable signature (a builtin): it is called and fails there if wrong
    try:
        signature.bind(*kind.call, **{k: True for k in kind.keywords})
    except TypeError:
        raise ConfigError(f"{what} has signature {signature}; expected {kind.shown}", (kind.flag,)) from None
