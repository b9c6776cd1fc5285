"""Where prompts and rewards come from: ``--prompt-data`` (JSONL) or a built-in ``--task``."""

from __future__ import annotations

from miles_disagg.config.components import RolloutConfig
from miles_disagg.rollout.data import PromptDataset
from miles_disagg.rollout.rewards import RewardFn, get_reward_fn


def make_prompt_source(config: RolloutConfig, tokenizer, seed: int) -> PromptDataset:
    if config.prompt_data:
        return PromptDataset.from_jsonl(
            config.prompt_data, config.input_key, config.label_key, apply_chat_template=config.apply_chat_template,
            tokenizer=tokenizer, shuffle=config.rollout_shuffle, seed=seed, metadata_key=config.metadata_key)
    from miles_disagg.rollout.tasks import task_dataset

    return task_dataset(config.task, response_len=config.rollout_max_response_len, seed=seed)


def make_reward(config: RolloutConfig) -> RewardFn:
    """``--custom-rm-path``, else ``--rm-type``, else the built-in task's own reward."""
    import miles_disagg.rollout.tasks  # noqa: F401  (registers the task rewards)

    rm_type = config.rm_type or (None if config.prompt_data else config.task)
    return get_reward_fn(rm_type, config.custom_rm_path)
