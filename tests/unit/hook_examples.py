"""Rollout hooks written the way a user writes them, loaded by dotted path in the tests."""

from __future__ import annotations

TOOL_TEXT = "99"


async def two_turns_with_a_tool(args, sample, sampling_params):
    """Turn 1 (2 tokens), a tool answer (masked), turn 2 (2 tokens)."""
    params = {**sampling_params, "max_new_tokens": 2}
    sample = await args.engine.generate(sample, params)
    args.engine.append_tool_output(sample, TOOL_TEXT)
    sample = await args.engine.generate(sample, params)
    sample.metadata["turns"] = 2
    return sample


async def posts_around_the_router(args, sample, sampling_params):
    """Wrong: fills the response itself, with no engine call through args.engine."""
    sample.append_response([4, 5], [-0.1, -0.1], trained=True)
    return sample


def generate_not_async(args, sample, sampling_params):
    return sample


async def generate_too_few_arguments(args, sample):
    return sample


def newest_first(args, rollout_id, buffer, num_samples):
    """A buffer filter that trains on the most recent groups."""
    return list(reversed(buffer))[:num_samples]


def returns_foreign_groups(args, rollout_id, buffer, num_samples):
    return [[*group] for group in buffer[:num_samples]] + [[]]


def minus_one_advantages(args, samples):
    return [s.reward for s in samples], [-1.0] * len(samples)


async def rollout_of_first_prompts(args, rollout_id, data_source, evaluation=False):
    """A rollout function: draw ``rollout_batch_size`` prompts, generate and score them the default way."""
    groups = data_source.get_samples(args.rollout_batch_size)
    return [await args.generate_group(group) for group in groups]


async def eval_each_dataset(args, rollout_id, data_source, evaluation=True):
    """An eval function: each data set generated the default way; reward = reward of each sample."""
    data = {}
    for name, groups in data_source.datasets.items():
        samples = [s for group in groups for s in await args.generate_group(group)]
        data[name] = {"rewards": [s.reward for s in samples], "samples": samples}
    return data


async def ends_with_a_tool(args, sample, sampling_params):
    """One turn, then a tool answer no engine call follows (no engine ever ran those tokens)."""
    sample = await args.engine.generate(sample, {**sampling_params, "max_new_tokens": 2})
    args.engine.append_tool_output(sample, TOOL_TEXT)
    return sample
