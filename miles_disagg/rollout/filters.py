"""Group filters: dynamic sampling (per completed group) and the buffer filter (what to train on next).

Dynamic sampling (``--dynamic-sampling-filter-path``, miles' contract): after a group is generated
and scored, ``filter(args, samples)`` decides whether it is kept. A dropped group never reaches
the trainer; the rollout generates another in its place, so every batch still holds
``--rollout-batch-size`` kept groups. The filter returns :class:`FilterOutput` (``keep`` and a
short ``reason`` that names a metric) or a plain bool. Built in:

* :func:`check_reward_nonzero_std` - DAPO's filter: drop a group whose rewards are all equal
  (its GRPO advantages would all be zero: no learning signal).
* :func:`check_no_aborted` - drop a group with an aborted sample.

Buffer filter (``--buffer-filter-path``): ``buffer_filter(args, rollout_id, buffer, num_samples)``
gets the admissible buffered groups (oldest first, each a ``list[Sample]``) and returns the
``num_samples`` groups to train on next; they leave the buffer, the rest stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from miles_disagg.samples import Group, Sample, SampleStatus
from miles_disagg.types import FailRun


class FilterError(FailRun):
    """A filter hook returned something the rollout cannot use."""


@dataclass(frozen=True)
class FilterOutput:
    """A dynamic filter's decision (miles' ``DynamicFilterOutput``)."""

    keep: bool
    reason: str | None = None


DynamicFilterOutput = FilterOutput


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> FilterOutput:
    """Keep a group only if its rewards are not all equal (population std above 1e-8)."""
    rewards = [float(s.reward) for s in samples]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std > 1e-8:
        return FilterOutput(True)
    return FilterOutput(False, f"zero_std_{round(rewards[0], 1)}")


def check_no_aborted(args: Any, samples: list[Sample], **kwargs: Any) -> FilterOutput:
    """Drop a group in which a sample was aborted."""
    if any(s.status == SampleStatus.ABORTED for s in samples):
        return FilterOutput(False, "group_has_aborted")
    return FilterOutput(True)


def apply_dynamic_filter(fn: Callable | None, args: Any, group: Group) -> FilterOutput:
    """Call a dynamic filter on one group's samples; a bool result means ``keep``."""
    if fn is None:
        return FilterOutput(True)
    output = fn(args, group.samples)
    if isinstance(output, FilterOutput) or (hasattr(output, "keep") and hasattr(output, "reason")):
        return FilterOutput(bool(output.keep), output.reason)
    if isinstance(output, bool) or type(output).__name__ == "bool_":  # numpy/torch bools too
        return FilterOutput(bool(output))
    raise FilterError(f"--dynamic-sampling-filter-path returned {output!r}; expected FilterOutput or bool")


def buffer_selector(fn: Callable, args_of: Callable[[], Any]) -> Callable[[list[Group], int], list[Group]]:
    """Adapt a miles buffer filter to :class:`~miles_disagg.rollout.buffer.GroupBuffer`'s selector:
    groups in, the chosen groups out (checked: exactly ``n``, each one of the offered groups, once)."""

    def select(groups: list[Group], n: int) -> list[Group]:
        offered = [list(g.samples) for g in groups]
        chosen = fn(args_of(), None, offered, n)
        if not isinstance(chosen, list):
            raise FilterError(f"--buffer-filter-path returned {type(chosen).__name__}; expected a list of groups")
        by_samples = {tuple(map(id, g.samples)): g for g in groups}
        picked: list[Group] = []
        for item in chosen:
            group = by_samples.get(tuple(map(id, item))) if isinstance(item, list) else None
            if group is None or any(group is p for p in picked):
                raise FilterError("--buffer-filter-path must return groups taken from the buffer it was given, "
                                  "each at most once")
            picked.append(group)
        if len(picked) != n:
            raise FilterError(f"--buffer-filter-path returned {len(picked)} groups; {n} were asked for")
        return picked

    return select
