"""``miles.rollout.base_types``: the types of miles' class-based rollout and eval functions.

A class given to ``--rollout-function-path`` / ``--eval-function-path`` is constructed once with
``RolloutFnConstructorInput(args, data_source)`` and called with ``RolloutFnTrainInput(rollout_id)``
or ``RolloutFnEvalInput(rollout_id)`` (plain or ``async``); it returns ``RolloutFnTrainOutput``
(``samples``: groups, ``metrics``) or ``RolloutFnEvalOutput`` (``data``, ``metrics``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RolloutFnConstructorInput:
    args: Any
    data_source: Any


@dataclass(frozen=True)
class RolloutFnBaseInput:
    rollout_id: int

    @property
    def evaluation(self) -> bool:
        raise NotImplementedError("use RolloutFnTrainInput or RolloutFnEvalInput")


@dataclass(frozen=True)
class RolloutFnTrainInput(RolloutFnBaseInput):
    @property
    def evaluation(self) -> bool:
        return False


@dataclass(frozen=True)
class RolloutFnEvalInput(RolloutFnBaseInput):
    @property
    def evaluation(self) -> bool:
        return True


@dataclass
class RolloutFnTrainOutput:
    samples: list
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def call_rollout_fn(fn, *args, evaluation: bool, **kwargs):
    """A function-form rollout's result as the class form's output type."""
    output = fn(*args, **kwargs, evaluation=evaluation)
    if isinstance(output, (RolloutFnTrainOutput, RolloutFnEvalOutput)):
        return output
    return RolloutFnEvalOutput(data=output) if evaluation else RolloutFnTrainOutput(samples=output)


__all__ = ["RolloutFnConstructorInput", "RolloutFnBaseInput", "RolloutFnTrainInput", "RolloutFnEvalInput",
           "RolloutFnTrainOutput", "RolloutFnEvalOutput", "call_rollout_fn"]
