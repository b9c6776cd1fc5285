"""Values miles derives from other flags, resolved once before validation (so ``--print-config``
shows them): ``--num-epoch`` -> ``--num-rollout``, ``--num-steps-per-rollout`` ->
``--global-batch-size``, ``--ci-test`` -> ``--check-weight-update-equal``,
``--sglang-server-concurrency`` -> ``--rollout-concurrency``."""

from __future__ import annotations

from pathlib import Path

from miles_disagg.config.components import RunConfig
from miles_disagg.tracking import status
from miles_disagg.types import ConfigError


def resolve_derived(config: RunConfig) -> None:
    for step in (_num_rollout_from_epochs, _global_batch_from_steps, _ci_checks, _concurrency_per_engine):
        step(config)


def _num_rollout_from_epochs(config: RunConfig) -> None:
    rollout = config.rollout
    if rollout.num_epoch is None:
        return
    if rollout.num_rollout is not None:
        status(f"--num-rollout {rollout.num_rollout} is given: --num-epoch {rollout.num_epoch} is ignored (as miles does)")
        return
    if rollout.rollout_batch_size is None:
        raise ConfigError("--num-epoch needs --rollout-batch-size (num_rollout = num_epoch x prompts // "
                          "rollout_batch_size)", ("--num-epoch", "--rollout-batch-size"))
    if not rollout.prompt_data:
        raise ConfigError(f"--num-epoch counts passes over --prompt-data, and the built-in task --task "
                          f"{rollout.task} has no end: give --prompt-data or --num-rollout", ("--num-epoch",
                                                                                             "--prompt-data"))
    num_prompts = count_prompts(rollout.prompt_data)
    rollout.num_rollout = rollout.num_epoch * num_prompts // rollout.rollout_batch_size
    if rollout.num_rollout < 1:
        raise ConfigError(f"--num-epoch {rollout.num_epoch} over {num_prompts} prompts makes no full rollout of "
                          f"--rollout-batch-size {rollout.rollout_batch_size}", ("--num-epoch", "--rollout-batch-size"))


def count_prompts(path: str) -> int:
    """Non-empty lines of a JSONL prompt file (the dataset size miles divides by)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"--prompt-data {path!r} is not a file", ("--prompt-data",))
    with file.open("rb") as lines:
        return sum(1 for line in lines if line.strip())


def _global_batch_from_steps(config: RunConfig) -> None:
    rollout, train = config.rollout, config.train
    steps = train.num_steps_per_rollout
    if steps is None:
        return
    if rollout.rollout_batch_size is None:
        raise ConfigError("--num-steps-per-rollout needs --rollout-batch-size", ("--num-steps-per-rollout",
                                                                                  "--rollout-batch-size"))
    samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if samples % steps:
        raise ConfigError(f"--num-steps-per-rollout {steps} does not divide the {samples} samples of a rollout "
                          "(--rollout-batch-size x --n-samples-per-prompt)", ("--num-steps-per-rollout",))
    derived = samples // steps
    if train.global_batch_size is not None and train.global_batch_size != derived:
        raise ConfigError(f"--global-batch-size {train.global_batch_size} disagrees with --num-steps-per-rollout "
                          f"{steps} ({samples} samples // {steps} = {derived})",
                          ("--global-batch-size", "--num-steps-per-rollout"))
    train.global_batch_size = derived


def _ci_checks(config: RunConfig) -> None:
    ci, rollout = config.ci, config.rollout
    if not ci.ci_test or ci.ci_disable_weight_update_checker:
        return
    if rollout.debug_rollout_only or rollout.debug_train_only or rollout.rollout_service_url:
        return  # no update, or no engine to compare (as miles: not in the debug modes)
    ci.check_weight_update_equal = True


def _concurrency_per_engine(config: RunConfig) -> None:
    rollout, cluster = config.rollout, config.cluster
    per_engine = rollout.sglang_server_concurrency
    if per_engine is None or rollout.rollout_service_url:
        return
    if rollout.rollout_external:
        num_engines = len(rollout.rollout_external_engine_addrs)
    else:
        rollout_gpus = cluster.rollout_num_gpus or cluster.num_actor_gpus
        num_engines = max(1, rollout_gpus // cluster.rollout_num_gpus_per_engine)
    rollout.rollout_concurrency = per_engine * max(1, num_engines)
