"""Built-in multi-turn example: ``count-up-tool``, a counting episode with a tool turn in the middle.

Run it with ``configs/tiny_cpu_multiturn.yaml`` (``--task count-up-tool
--custom-generate-function-path miles_disagg.rollout.counter_tool.generate``). It exercises the
custom generate contract end to end on the tiny CPU model:

1. the policy writes ``TURN_TOKENS`` tokens after the prompt (``"345"`` -> ideally ``"67"``);
2. the environment runs a counter tool on the text so far: it reads the last digit and answers
   the next ``TOOL_DIGITS`` digits (``"67"`` -> ``"89"``). Its output is inserted into the
   response with ``loss_mask`` 0: the policy never gets gradient for text it did not write;
3. the policy writes ``TURN_TOKENS`` more tokens, continuing after the tool's output (``"01"``).

Each turn is one engine call through ``args.engine`` (version-constrained like every rollout
request), so a sample's start version is its first turn's and its end version its last turn's.
An episode ends early when the policy stops (EOS) in the first turn.

Reward (:func:`count_up_tool_reward`): the fraction of the ``2 * TURN_TOKENS`` expected policy
characters that are one more than the character before them (which may be a tool character).
Only the policy's own characters (``metadata["policy_positions"]``) are scored: the tool's
characters always count up, and scoring them would pay the policy for the tool's work.
"""

from __future__ import annotations

from typing import Any

from miles_disagg.rollout.data import Prompt, digit_run_prompts
from miles_disagg.samples import Sample

TURN_TOKENS = 2
TOOL_DIGITS = 2
PROMPT_DIGITS = 3
POLICY_CHARS = 2 * TURN_TOKENS
MAX_RESPONSE_LEN = 2 * TURN_TOKENS + TOOL_DIGITS


def counter_tool(text: str) -> str:
    """The next ``TOOL_DIGITS`` digits after the last digit of ``text`` (modulo 10)."""
    digits = [ch for ch in text if ch.isdigit()]
    last = int(digits[-1]) if digits else 0
    return "".join(str((last + i) % 10) for i in range(1, TOOL_DIGITS + 1))


async def generate(args, sample: Sample, sampling_params: dict) -> Sample:
    """``--custom-generate-function-path`` of the ``count-up-tool`` task (two policy turns, one tool turn)."""
    turn_params = {**sampling_params, "max_new_tokens": TURN_TOKENS}
    policy_positions: list[int] = []
    for turn in range(2):
        start = len(sample.response)
        sample = await args.engine.generate(sample, turn_params)
        policy_positions.extend(range(start, len(sample.response)))
        if turn == 1 or sample.finish_reason != "length":  # the last turn, or the policy stopped
            break
        args.engine.append_tool_output(sample, counter_tool(sample.prompt + sample.response))
    sample.metadata["policy_positions"] = policy_positions
    return sample


def count_up_tool_reward(prompt: str, response: str, label: Any, metadata: dict) -> float:
    """Fraction of the ``label`` expected policy characters that count up from the character before them."""
    positions = metadata.get("policy_positions", range(len(response)))
    context = prompt + response
    offset = len(prompt)
    score = sum(1 for p in positions if p < len(response) and _counts_up(context[offset + p - 1], response[p]))
    return score / int(label)


def _counts_up(previous: str, char: str) -> bool:
    return previous.isdigit() and char == str((int(previous) + 1) % 10)


def count_up_tool_prompts(num_prompts: int, response_len: int, seed: int) -> list[Prompt]:
    """Runs of ``PROMPT_DIGITS`` consecutive digits; the label is the number of policy characters scored."""
    return digit_run_prompts(num_prompts, PROMPT_DIGITS, label=POLICY_CHARS, seed=seed)
