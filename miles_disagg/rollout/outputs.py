"""What rollout, eval and reward post-process hooks return, turned into this project's types.

* A rollout function returns miles' ``RolloutFnTrainOutput`` (``.samples``: groups, ``.metrics``)
  or just the groups (``list[list[Sample]]``).
* An eval function returns miles' ``RolloutFnEvalOutput`` (``.data``) or just the data:
  ``{name: {"rewards": [...], "truncated": [...], "samples": [...]}}``; ``eval/<name>`` is the
  mean of ``rewards``.
* A reward post-process returns ``(raw_rewards, rewards)``, one of each per sample: the raw reward
  is kept as the sample's reward (logged), the other becomes its advantage.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

from miles_disagg.rollout.generate import GenerationFailed
from miles_disagg.samples import Group, Sample


def groups_from_rollout_output(output: Any, finish: Callable[[Sample], Sample]) -> tuple[list[Group], dict]:
    """The groups (each sample checked and scored by ``finish``) and the metrics a rollout function returned."""
    raw_groups = getattr(output, "samples", output)
    metrics = dict(getattr(output, "metrics", None) or {})
    if not isinstance(raw_groups, list) or not all(isinstance(g, list) and g for g in raw_groups):
        raise GenerationFailed("--rollout-function-path must return groups: a list of non-empty lists of Sample "
                               "(or an object whose .samples holds them)")
    groups = []
    for raw in raw_groups:
        samples = [finish(sample) for sample in raw]
        groups.append(Group(prompt_index=int(samples[0].metadata.get("prompt_index", -1)), samples=samples))
    return groups, {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}


def eval_metrics(output: Any, version: int) -> dict[str, float]:
    """``eval/<name>``, ``eval/<name>_samples`` and ``eval/<name>_version`` from an eval function's output."""
    data = getattr(output, "data", output)
    if not isinstance(data, dict) or not all(isinstance(v, dict) and "rewards" in v for v in data.values()):
        raise GenerationFailed("--eval-function-path must return {name: {'rewards': [...], ...}} "
                               "(or an object whose .data holds it)")
    metrics: dict[str, float] = {}
    for name, info in data.items():
        rewards = [_finite(r, f"eval reward of {name!r}") for r in info["rewards"]]
        if not rewards:
            raise GenerationFailed(f"--eval-function-path returned no rewards for {name!r}")
        metrics[f"eval/{name}"] = sum(rewards) / len(rewards)
        metrics[f"eval/{name}_samples"] = float(len(rewards))
        metrics[f"eval/{name}_version"] = float(version)
    for key, value in dict(getattr(output, "metrics", None) or {}).items():
        metrics[key if key.startswith("eval/") else f"eval/{key}"] = _finite(value, key)
    return metrics


def post_process_rewards(fn: Callable, args: Any, groups: list[Group]) -> None:
    """Call ``--custom-reward-post-process-path`` on the batch's samples (group by group, in order) and
    set each sample's reward to the raw reward and its advantage to the post-processed one."""
    samples = [s for g in groups for s in g.samples]
    result = fn(args, samples)
    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        raise GenerationFailed("--custom-reward-post-process-path must return (raw_rewards, rewards)")
    raw, processed = (list(_as_floats(r)) for r in result)
    if len(raw) != len(samples) or len(processed) != len(samples):
        raise GenerationFailed(f"--custom-reward-post-process-path returned {len(raw)} raw rewards and "
                               f"{len(processed)} rewards for {len(samples)} samples")
    for sample, r, p in zip(samples, raw, processed):
        sample.reward = _finite(r, "raw reward")
        sample.advantage = _finite(p, "post-processed reward")


def _as_floats(values: Any) -> list[float]:
    values = values.tolist() if hasattr(values, "tolist") else values
    return [float(v) for v in values]


def _finite(value: Any, what: str) -> float:
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise GenerationFailed(f"{what} must be a finite number, got {value!r}")
    return float(value)
