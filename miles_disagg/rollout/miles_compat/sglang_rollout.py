"""``miles.rollout.sglang_rollout``: ``GenerateState``, ``generate``, ``generate_and_rm``,
``generate_and_rm_group``, as miles' generate hooks use them.

Every call goes through this run's rollout (``args.engine``, ``args.generate_group``): version
constraint, retries, attribution and the run's reward are those of every other sample.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from miles_disagg.samples import Sample

_SEMAPHORES: "weakref.WeakKeyDictionary[Any, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


class GenerateState:
    """miles' per-run generation state: ``tokenizer``, ``sampling_params`` (the run's, a fresh dict),
    ``semaphore`` (one per run, ``--rollout-concurrency`` wide) and ``processor`` (None: text only)."""

    def __init__(self, args: Any):
        self.args = args
        self.tokenizer = args.tokenizer
        self.processor = None
        self.sampling_params = args.sampling_params
        engine = args.engine
        if engine not in _SEMAPHORES:
            _SEMAPHORES[engine] = asyncio.Semaphore(max(1, int(getattr(args, "rollout_concurrency", 64))))
        self.semaphore = _SEMAPHORES[engine]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"GenerateState.{name} is a miles name that miles-disagg does not serve (it has args, "
                             "tokenizer, processor, sampling_params, semaphore): the rollout manager schedules "
                             "generation here")


async def generate(args: Any, sample: Sample, sampling_params: dict[str, Any]) -> Sample:
    """miles' default generation: one engine call continuing ``sample`` (appended, loss_mask 1)."""
    return await args.engine.generate(sample, sampling_params)


async def generate_and_rm(args: Any, sample: Sample, sampling_params: dict[str, Any] | None = None,
                          evaluation: bool = False) -> Sample:
    """Generate ``sample`` the way the rollout does (the custom generate function if one is set) and score it."""
    return (await args.generate_group([sample]))[0]


async def generate_and_rm_group(args: Any, group: list[Sample], sampling_params: dict[str, Any] | None = None,
                                evaluation: bool = False) -> list[Sample]:
    """Generate and score one group (``--group-rm``: one reward call for the group)."""
    return await args.generate_group(list(group))


__all__ = ["GenerateState", "generate", "generate_and_rm", "generate_and_rm_group"]
