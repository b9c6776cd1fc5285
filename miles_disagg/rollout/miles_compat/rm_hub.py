"""``miles.rollout.rm_hub`` and the scorer modules miles' examples import from it
(``math_dapo_utils.compute_score``, ``math_utils.extract_answer`` / ``grade_answer_verl``, ``f1``,
``gpqa``, ``deepscaler``), with miles' return values. Scoring is this project's own code
(``rollout/miles_rm_types.py``, ``rollout/answer_scoring.py``)."""

from __future__ import annotations

import asyncio
from typing import Any

from miles_disagg.rollout import miles_rm_types
from miles_disagg.rollout.miles_rm_types import dapo_normalize as normalize_final_answer
from miles_disagg.rollout.miles_rm_types import f1_score
from miles_disagg.rollout.answer_scoring import answers_match, deepscaler_reward, label_answers, last_boxed


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """miles' ``async_rm``: ``--custom-rm-path`` if given, else the sample's or the run's ``--rm-type``."""
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        from miles_disagg.rollout.hooks import import_path

        return await import_path(custom, "--custom-rm-path")(args, sample, **kwargs)
    return await miles_rm_types.async_rm(args, sample, **kwargs)


async def batched_async_rm(args: Any, samples: list, **kwargs: Any) -> list:
    """miles' ``batched_async_rm``: a ``--custom-rm-path`` group reward, else each sample's ``async_rm``."""
    custom = getattr(args, "custom_rm_path", None)
    if custom:
        from miles_disagg.rollout.hooks import import_path

        return await import_path(custom, "--custom-rm-path")(args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: Any = None, meta_data: dict | None = None) -> dict[str, Any]:
    """DAPO's score (``{"score": 1.0 | -1.0, "acc", "pred"}``; the ``Answer:`` line form)."""
    if strict_box_verify:
        raise NotImplementedError("compute_score(strict_box_verify=True) is not served by miles-disagg")
    return miles_rm_types.dapo_score(solution_str, ground_truth)


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` of ``string``, command included, or None."""
    content = last_boxed(string) if "\\boxed{" in string else None
    return None if content is None else "\\boxed{" + content + "}"


def remove_boxed(s: str) -> str:
    if not (s.startswith("\\boxed{") and s.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} string: {s[:80]!r}")
    return s[len("\\boxed{"):-1]


def extract_answer(passage: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (miles' ``math_utils.extract_answer``)."""
    return last_boxed(passage) if passage else None


extract_boxed_answer = extract_answer


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """Whether the solution's final answer matches the label (this project's math matching)."""
    if not ground_truth or not solution_str:
        return False
    answer = extract_answer(solution_str) or solution_str
    return any(answers_match(answer, gold) for gold in label_answers(ground_truth))


def compute_gpqa_reward(response: str, label: Any, metadata: dict | None = None) -> float:
    return miles_rm_types.gpqa_reward(response, label, metadata)


def get_deepscaler_rule_based_reward(response: str, label: Any) -> int:
    return int(deepscaler_reward("", response, label, {}))


__all__ = ["async_rm", "batched_async_rm", "compute_score", "normalize_final_answer", "last_boxed_only_string",
           "remove_boxed", "extract_answer", "extract_boxed_answer", "grade_answer_verl", "f1_score",
           "compute_gpqa_reward", "get_deepscaler_rule_based_reward"]
