"""The built-in count-up task: prompts and reward."""

from __future__ import annotations

import pytest

from miles_disagg.rollout.rewards import get_reward_fn
from miles_disagg.rollout.tasks import count_up_reward, task_dataset
from miles_disagg.types import ConfigError


@pytest.mark.parametrize("prompt, response, expected", [
    ("345", "678", 1.0),
    ("789", "012", 1.0),
    ("345", "6x8", 1 / 3),       # credit restarts only after a digit
    ("345", "789", 2 / 3),       # a wrong first step, then counting up from it
    ("345", "6", 1 / 3),         # too short
    ("345", "", 0.0),
    ("345", "6789", 1.0),        # extra characters are ignored
])
def test_count_up_reward(prompt: str, response: str, expected: float) -> None:
    assert count_up_reward(prompt, response, 3, {}) == pytest.approx(expected)


def test_task_dataset_and_registered_reward() -> None:
    dataset = task_dataset("count-up", response_len=3, seed=0)
    batch = dataset.next_batch(5)
    assert len(batch) == 5
    for prompt in batch:
        digits = [int(c) for c in prompt.text]
        assert len(digits) == 3 and all((b - a) % 10 == 1 for a, b in zip(digits, digits[1:]))
        assert prompt.label == 3
    reward = get_reward_fn("count-up", None)
    assert reward("012", "345", 3, {}) == 1.0
    with pytest.raises(ConfigError, match="--task"):
        task_dataset("nope", response_len=3, seed=0)
