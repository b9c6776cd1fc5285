"""Built-in procedural tasks: prompts made on the spot and a rule reward (no downloads).

``count-up``: the prompt is a run of consecutive digits (``"345"``); the policy should keep
counting, modulo 10 (``"678"``). The reward is the fraction of response positions whose
character is one more than the character before it (the prompt's last digit for the first
position), so each correct step earns credit even after a mistake. A random policy over a
digits vocabulary scores about 0.05; a tiny Qwen3 learns it from random weights in a few
dozen GRPO steps.

``count-up-tool``: the multi-turn version (two policy turns around a counter tool's output,
which is masked out of the loss); it needs its generate function,
``--custom-generate-function-path miles_disagg.rollout.counter_tool.generate``
(``rollout/counter_tool.py``).
"""

from __future__ import annotations

from typing import Any

from miles_disagg.rollout.data import Prompt, PromptDataset, digit_run_prompts
from miles_disagg.rollout.rewards import register_reward
from miles_disagg.types import ConfigError

COUNT_UP_PROMPT_DIGITS = 3
COUNT_UP_NUM_PROMPTS = 1000


def count_up_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """Fraction of the first ``label`` response characters that count up from the one before."""
    length = int(label)
    previous = prompt[-1:] if prompt else ""
    score = 0
    for position in range(length):
        char = response[position] if position < len(response) else ""
        if previous.isdigit() and char == str((int(previous) + 1) % 10):
            score += 1
        previous = char
    return score / length if length else 0.0


def count_up_prompts(num_prompts: int, response_len: int, seed: int) -> list[Prompt]:
    return digit_run_prompts(num_prompts, COUNT_UP_PROMPT_DIGITS, label=response_len, seed=seed)


def _task_table() -> dict:
    from miles_disagg.rollout.counter_tool import count_up_tool_prompts, count_up_tool_reward

    return {"count-up": (count_up_prompts, count_up_reward),
            "count-up-tool": (count_up_tool_prompts, count_up_tool_reward)}


TASKS = _task_table()
for _name, (_, _reward) in TASKS.items():
    register_reward(_name, _reward)


def task_dataset(name: str, *, response_len: int, seed: int, shuffle: bool = True) -> PromptDataset:
    """The prompts of built-in task ``name`` (its reward is registered under the same name)."""
    if name not in TASKS:
        raise ConfigError(f"--task {name!r} is unknown; built-in tasks: {sorted(TASKS)}", ("--task",))
    make_prompts, _ = TASKS[name]
    return PromptDataset(make_prompts(COUNT_UP_NUM_PROMPTS, response_len, seed), shuffle=shuffle, seed=seed)
