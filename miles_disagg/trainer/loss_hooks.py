"""miles' loss extension points: user functions named by path, with miles' signatures.

=============================================  ==================================================================
flag                                           called as
=============================================  ==================================================================
``--custom-loss-function-path``                ``fn(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)``
                                               (with ``--loss-type custom_loss``; miles' newer form
                                               ``fn(args, parallel_state, batch, logits, sum_of_sample_mean)``
                                               is recognised by its ``parallel_state`` parameter)
``--custom-tis-function-path``                 ``fn(args, *, pg_loss, train_log_probs, rollout_log_probs,
                                               loss_masks, **kwargs) -> (pg_loss, loss_masks, metrics)``
                                               (with ``--use-tis`` or ``--get-mismatch-metrics``)
``--custom-pg-loss-reducer-function-path``     ``fn(total_lengths, response_lengths, loss_masks,
                                               calculate_per_token_loss) -> reducer``; ``reducer(pg_loss)``
                                               replaces the default reduction of the policy loss only
=============================================  ==================================================================

A path is miles' dotted form or ours (``pkg.module:function``). :func:`load_train_hooks` imports
each and checks its signature; a wrong one is a one-line ``ConfigError`` naming the flag, before
anything starts (the driver's preflight) and again on every trainer rank.

Tensors are in miles' layout (:mod:`miles_disagg.trainer.miles_layout`): per-sample lists and flat
per-token tensors. A loss returns its value in sum form, as miles' ``sum_of_sample_mean`` gives it;
the backend divides by the step's global sample (or token) count and averages over ranks.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from miles_disagg.rollout.hooks import HookKind, check_signature, import_path
from miles_disagg.types import ConfigError

CUSTOM_LOSS = HookKind("--custom-loss-function-path", ("args", "batch", "logits", "sum_of_sample_mean"), False,
                       "def loss(args, batch, logits, sum_of_sample_mean) -> (loss, metrics)")
CUSTOM_TIS = HookKind("--custom-tis-function-path", ("args",), False,
                      "def tis(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, **kwargs) -> "
                      "(pg_loss, loss_masks, metrics)",
                      keywords=("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks"))
PG_LOSS_REDUCER = HookKind("--custom-pg-loss-reducer-function-path",
                           ("total_lengths", "response_lengths", "loss_masks", "calculate_per_token_loss"), False,
                           "def get_pg_loss_reducer(total_lengths, response_lengths, loss_masks, "
                           "calculate_per_token_loss=False) -> reducer")

TIS_KEYWORDS = ("pg_loss", "train_log_probs", "rollout_log_probs", "loss_masks", "total_lengths",
                "response_lengths", "parallel_state", "max_seq_lens", "cur_log_probs")
"""What miles passes a TIS function (``cur_log_probs``: the current policy's, detached). A function
without ``**kwargs`` gets those of them it names."""


@dataclass(frozen=True)
class TrainHooks:
    """The loaded loss hooks of one run; None where the flag is not given."""

    custom_loss: Callable | None = None
    custom_loss_takes_parallel_state: bool = False
    tis: Callable | None = None
    pg_loss_reducer: Callable | None = None


def load_train_hooks(config) -> TrainHooks:
    """Import and check the hooks a ``TrainConfig`` names (``ConfigError`` naming the flag).

    The miles import paths the hooks may use must be served first
    (:func:`miles_disagg.trainer.miles_loss_api.load_hooks` does both)."""
    custom_loss, with_state = None, False
    if config.custom_loss_function_path:
        custom_loss = import_path(config.custom_loss_function_path, CUSTOM_LOSS.flag)
        with_state = check_loss_signature(custom_loss, config.custom_loss_function_path)
    tis = reducer = None
    if config.custom_tis_function_path:
        tis = import_path(config.custom_tis_function_path, CUSTOM_TIS.flag)
        check_signature(tis, CUSTOM_TIS, config.custom_tis_function_path)
    if config.custom_pg_loss_reducer_function_path:
        reducer = import_path(config.custom_pg_loss_reducer_function_path, PG_LOSS_REDUCER.flag)
        check_signature(reducer, PG_LOSS_REDUCER, config.custom_pg_loss_reducer_function_path)
    return TrainHooks(custom_loss=custom_loss, custom_loss_takes_parallel_state=with_state, tis=tis,
                      pg_loss_reducer=reducer)


def check_loss_signature(fn: Any, spec: str) -> bool:
    """``ConfigError`` unless ``fn`` is a plain function miles can call as a loss; True when it is
    miles' newer form that takes ``parallel_state`` second."""
    what = f"{CUSTOM_LOSS.flag} {spec!r}"
    if not callable(fn) or inspect.iscoroutinefunction(fn):
        raise ConfigError(f"{what} must be a plain (synchronous) function: {CUSTOM_LOSS.shown}", (CUSTOM_LOSS.flag,))
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    names = list(signature.parameters)
    with_state = len(names) > 1 and names[1] == "parallel_state"
    call = ("args", "parallel_state", *CUSTOM_LOSS.call[1:]) if with_state else CUSTOM_LOSS.call
    try:
        signature.bind(*call)
    except TypeError:
        raise ConfigError(f"{what} has signature {signature}; expected {CUSTOM_LOSS.shown}",
                          (CUSTOM_LOSS.flag,)) from None
    return with_state


def call_tis(fn: Callable, args, **kwargs) -> tuple[Any, list, dict]:
    """Call a TIS function with miles' keywords (only those it names when it takes no ``**kwargs``)
    and check its answer's shape; ``ValueError`` naming the flag otherwise."""
    try:
        parameters = inspect.signature(fn).parameters.values()
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            named = {p.name for p in parameters}
            kwargs = {key: value for key, value in kwargs.items() if key in named}
    except (TypeError, ValueError):
        pass
    answer = fn(args, **kwargs)
    if not (isinstance(answer, tuple) and len(answer) == 3):
        raise ValueError(f"{CUSTOM_TIS.flag}: expected (pg_loss, loss_masks, metrics), got {type(answer).__name__}")
    return answer
