"""Evaluation with the exact current policy version; eval samples are never trained on.

With ``--eval-function-path`` the user's eval rollout replaces the built-in one: it is called with
the eval prompt sets (``data_source.datasets``, possibly empty) and every engine call it makes
through ``args.engine`` asks for exactly the current version.
"""

from __future__ import annotations

from typing import Any

from miles_disagg.config.components import RunConfig


def eval_prompts(config: RunConfig, name: str, path: str, tokenizer=None) -> list:
    """The first ``--eval-max-prompts`` prompts of a JSONL file, or of ``task:NAME``."""
    from miles_disagg.rollout.data import PromptDataset

    limit = config.eval.eval_max_prompts
    if path.startswith("task:"):
        from miles_disagg.rollout.tasks import task_dataset

        dataset = task_dataset(path.removeprefix("task:"), response_len=_max_len(config), seed=config.train.seed + 7,
                               shuffle=False)
    else:
        dataset = PromptDataset.from_jsonl(path, config.rollout.input_key, config.rollout.label_key,
                                           apply_chat_template=config.rollout.apply_chat_template, tokenizer=tokenizer,
                                           shuffle=False, seed=0, metadata_key=config.rollout.metadata_key)
    return dataset.next_batch(min(limit, len(dataset)))


def _max_len(config: RunConfig) -> int:
    return config.eval.eval_max_response_len or config.rollout.rollout_max_response_len


def maybe_evaluate(job, step: int, version: int, *, last: bool = False) -> dict[str, Any]:
    """``eval/<name>`` (mean reward) and ``eval/<name>_version`` when the interval says so."""
    from miles_disagg.rollout.generate import SamplingSettings

    cfg = job.config
    interval = cfg.eval.eval_interval
    has_data = bool(cfg.eval.datasets or cfg.rollout.eval_function_path)
    if job.rollout is None or not has_data or not (last or (interval and (step + 1) % interval == 0)):
        return {}
    sampling = SamplingSettings(
        _max_len(cfg),
        cfg.eval.eval_temperature if cfg.eval.eval_temperature is not None else cfg.rollout.rollout_temperature,
        cfg.eval.eval_top_p if cfg.eval.eval_top_p is not None else cfg.rollout.rollout_top_p,
        cfg.rollout.rollout_top_k, tuple(cfg.rollout.rollout_stop), tuple(cfg.rollout.rollout_stop_token_ids))
    if cfg.rollout.eval_function_path:  # the user's eval rollout, over the same prompt sets
        datasets = {name: eval_prompts(cfg, name, path, tokenizer=_tokenizer(cfg)) for name, path in cfg.eval.datasets}
        return job.rollout.evaluate_with_function(step, version, datasets, sampling, cfg.eval.n_samples_per_eval_prompt)
    metrics: dict[str, Any] = {}
    for name, path in cfg.eval.datasets:
        prompts = eval_prompts(cfg, name, path, tokenizer=_tokenizer(cfg))
        result = job.rollout.evaluate(prompts, version, sampling, cfg.eval.n_samples_per_eval_prompt)
        metrics[f"eval/{name}"] = result["reward"]
        metrics[f"eval/{name}_version"] = version
        metrics[f"eval/{name}_samples"] = result["samples"]
    return metrics


def _tokenizer(cfg: RunConfig):
    if not cfg.rollout.apply_chat_template:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.train.hf_checkpoint)
