"""Scoring generated samples: this project's reward form beside miles' (``--custom-rm-path``, ``--rm-type``,
``--group-rm``, ``--reward-key``, ``--eval-reward-key``).

Two forms, told apart by the function itself:

* this project's: ``def reward(prompt, response, label, metadata) -> float`` (synchronous);
* miles': ``async def reward_func(args, sample, **kwargs)``, or with ``--group-rm``
  ``async def reward_func(args, samples, **kwargs) -> list`` (one call per group). It may return a
  number or a dict; a dict is read through ``--reward-key`` (``--eval-reward-key`` during
  evaluation, falling back to ``--reward-key``), and kept whole in ``metadata["reward_details"]``.

A sample whose generate function already set ``reward`` is not scored again (a dict it set is
read the same way). Whatever the form, the trained reward must be a finite number.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from typing import Any, Callable

from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.rollout.rewards import CUSTOM_RM_FLAG, get_reward_fn
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

GROUP_RM_FLAG = "--group-rm"


def is_miles_form(fn: Any) -> bool:
    """miles' reward form (``async def reward_func(args, sample, **kwargs)``) rather than this project's."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class SampleReward:
    """The run's reward: ``await reward.score(args, samples)`` sets each sample's float ``reward``."""

    def __init__(self, fn: Callable, name: str, *, reward_key: str | None = None,
                 eval_reward_key: str | None = None, group_rm: bool = False):
        self._fn, self.name, self.miles_form = fn, name, is_miles_form(fn)
        self._key, self._eval_key, self._group = reward_key, eval_reward_key, group_rm

    async def score(self, args: Any, samples: list[Sample]) -> None:
        todo = [s for s in samples if s.reward is None]
        if todo:
            for sample, value in zip(todo, await self._values(args, todo), strict=True):
                sample.reward = value
        key = (self._eval_key or self._key) if getattr(args, "evaluation", False) else self._key
        for sample in samples:
            sample.reward = self._number(sample, key)

    async def _values(self, args: Any, samples: list[Sample]) -> list[Any]:
        if not self.miles_form:
            return [self._fn(s.prompt, s.response, s.label, s.metadata) for s in samples]
        if self._group:
            values = await self._fn(args, samples)
            values = values.tolist() if hasattr(values, "tolist") else values
            if not isinstance(values, (list, tuple)) or len(values) != len(samples):
                raise GenerationFailed(f"{GROUP_RM_FLAG} reward {self.name!r} must return one reward per sample "
                                       f"({len(samples)}), got {values!r:.200}")
            return list(values)
        return list(await asyncio.gather(*(self._fn(args, s) for s in samples)))

    def _number(self, sample: Sample, key: str | None) -> float:
        value = sample.reward
        if isinstance(value, dict):
            if key is None:
                raise GenerationFailed(f"reward {self.name!r} returned a dict {sorted(value)!r}; say which entry is "
                                       "the reward with --reward-key (and --eval-reward-key for evaluation)")
            if key not in value:
                raise GenerationFailed(f"reward {self.name!r} returned a dict without --reward-key {key!r} "
                                       f"(it has {sorted(value)!r})")
            sample.metadata["reward_details"] = _plain(value)
            value = value[key]
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise GenerationFailed(f"reward {self.name!r} gave {value!r}; expected a finite number")
        return float(value)


def load_sample_reward(config) -> SampleReward:
    """The reward of a :class:`~miles_disagg.config.components.RolloutConfig` run: ``--custom-rm-path``,
    else ``--rm-type``, else the built-in task's (``ConfigError`` naming the flag on any problem)."""
    import miles_disagg.rollout.tasks  # noqa: F401  (registers the task rewards)

    rm_type = config.rm_type or (None if config.prompt_data else config.task)
    keys = {"reward_key": getattr(config, "reward_key", None),
            "eval_reward_key": getattr(config, "eval_reward_key", None),
            "group_rm": bool(getattr(config, "group_rm", False))}
    fn = get_reward_fn(rm_type, config.custom_rm_path)
    fn = getattr(fn, "__wrapped__", fn) if not is_miles_form(fn) and keys["reward_key"] else fn
    if keys["group_rm"] and not config.custom_rm_path:  # miles: without a custom reward, each sample is scored
        keys["group_rm"] = False
    if keys["group_rm"] and not is_miles_form(fn):
        raise ConfigError(f"{GROUP_RM_FLAG} scores a whole group in one call of miles' form async def "
                          "reward_func(args, samples, **kwargs) given by --custom-rm-path; "
                          f"{config.custom_rm_path or rm_type!r} is not one", (GROUP_RM_FLAG, CUSTOM_RM_FLAG))
    return SampleReward(fn, config.custom_rm_path or rm_type, **keys)


def _plain(value: Any) -> Any:
    """A JSON-friendly copy of a reward dict (saved with the sample)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else repr(value)
