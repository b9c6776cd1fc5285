"""Rules over the loss and advantage flags (miles' own rejections first, with miles' meaning).

Each failure is one ``ConfigError`` line naming the flags, what is wrong and what to give instead.
"""

from __future__ import annotations

from miles_disagg.types import ConfigError

REINFORCE_ESTIMATORS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")


def check_loss_rules(config) -> None:
    """``ConfigError`` for the first invalid combination of a ``RunConfig``'s loss flags."""
    train = config.train
    _check_miles_rejections(train)
    _check_loss_type(train)
    _check_skip_forward(config)


def _check_miles_rejections(train) -> None:
    if train.kl_coef != 0 and train.kl_loss_coef != 0:
        raise ConfigError("--kl-coef (a KL penalty in the reward) and a non-zero --kl-loss-coef (a KL term in the "
                          "loss): only one of them can be set (miles refuses both too); drop one",
                          ("--kl-coef", "--kl-loss-coef"))
    if train.advantage_estimator in REINFORCE_ESTIMATORS and not train.normalize_advantages:
        raise ConfigError(f"--advantage-estimator {train.advantage_estimator} requires advantage normalization "
                          "(miles refuses it without too): add --normalize-advantages",
                          ("--advantage-estimator", "--normalize-advantages"))
    if train.get_mismatch_metrics and not train.custom_tis_function_path:
        raise ConfigError("--get-mismatch-metrics reports what a --custom-tis-function-path computes (miles refuses it "
                          "without one too): give --custom-tis-function-path pkg.module.function",
                          ("--get-mismatch-metrics", "--custom-tis-function-path"))
    if train.custom_tis_function_path and not (train.use_tis or train.get_mismatch_metrics):
        raise ConfigError("--custom-tis-function-path is called only with --use-tis or --get-mismatch-metrics: add one "
                          "of them, or drop it", ("--custom-tis-function-path", "--use-tis"))


def _check_loss_type(train) -> None:
    loss_type = train.loss_type
    if loss_type == "custom_loss" and not train.custom_loss_function_path:
        raise ConfigError("--loss-type custom_loss needs --custom-loss-function-path pkg.module.function",
                          ("--loss-type", "--custom-loss-function-path"))
    if train.custom_loss_function_path and loss_type != "custom_loss":
        raise ConfigError(f"--custom-loss-function-path is the loss only with --loss-type custom_loss (this run has "
                          f"--loss-type {loss_type}): add --loss-type custom_loss, or drop it",
                          ("--custom-loss-function-path", "--loss-type"))
    if loss_type == "custom_loss" and train.context_parallel_size > 1:
        raise ConfigError("--loss-type custom_loss hands the function whole sequences' logits, and "
                          f"--context-parallel-size {train.context_parallel_size} splits them over ranks: use "
                          "--context-parallel-size 1", ("--loss-type", "--context-parallel-size"))
    if train.disable_compute_advantages_and_returns and loss_type == "policy_loss":
        raise ConfigError("--disable-compute-advantages-and-returns leaves the policy loss without advantages: use it "
                          "with --loss-type sft_loss or custom_loss", ("--disable-compute-advantages-and-returns",
                                                                       "--loss-type"))
    if train.custom_pg_loss_reducer_function_path and loss_type == "sft_loss":
        raise ConfigError("--custom-pg-loss-reducer-function-path reduces the policy loss, and --loss-type sft_loss "
                          "has none: drop it", ("--custom-pg-loss-reducer-function-path", "--loss-type"))


def _check_skip_forward(config) -> None:
    """``--skip-actor-forward-only`` reuses the training pass's logprobs, which exist only once the
    step runs: one optimizer step per rollout, and nothing that needs them before (miles' rules)."""
    train = config.train
    if not train.skip_actor_forward_only:
        return
    flag = "--skip-actor-forward-only"
    if train.train_backend != "megatron":
        raise ConfigError(f"{flag} skips the Megatron actor's forward-only pass (miles' rule: megatron only), and "
                          f"this run has --train-backend {train.train_backend}: use --train-backend megatron or drop "
                          f"{flag}", (flag, "--train-backend"))
    if train.loss_type == "sft_loss":
        raise ConfigError(f"{flag} with --loss-type sft_loss: the supervised loss has no behaviour logprobs to skip "
                          f"(miles refuses it too): drop {flag}", (flag, "--loss-type"))
    for name, given in (("--kl-coef", train.kl_coef != 0), ("--use-opd", train.use_opd)):
        if given:
            raise ConfigError(f"{flag} with {name}: the advantages need the behaviour logprobs before training, which "
                              f"the skipped pass gives (miles refuses it, --use-rollout-logprobs or not): drop {name} "
                              f"or {flag}", (flag, name))
    _check_one_step(config, flag)


def _check_one_step(config, flag: str) -> None:
    train, rollout = config.train, config.rollout
    if train.num_steps_per_rollout not in (None, 1):
        raise ConfigError(f"{flag} needs one optimizer step per rollout (miles' rule): use --num-steps-per-rollout 1",
                          (flag, "--num-steps-per-rollout"))
    if train.global_batch_size is not None and rollout.rollout_batch_size is not None:
        samples = rollout.rollout_batch_size * rollout.n_samples_per_prompt
        if train.global_batch_size != samples:
            raise ConfigError(f"{flag} needs one optimizer step per rollout (miles' rule): --global-batch-size "
                              f"{train.global_batch_size} splits the rollout's {samples} samples; give "
                              f"--global-batch-size {samples}", (flag, "--global-batch-size"))
