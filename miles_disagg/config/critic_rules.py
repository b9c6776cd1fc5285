"""PPO's critic (``--advantage-estimator ppo``): whether a run has one, where it saves and loads,
and the combinations it cannot take (each refused with one ``ConfigError`` line).

miles' defaults: the critic's GPUs are the actor's (``ClusterConfig.num_critic_gpus``), its lr is
``--lr``, it saves to ``--save`` with ``_critic`` appended. It resumes from ``--critic-load``, by
default ``--load`` with ``_critic`` appended (miles' default, ``--load`` itself, would read the
policy's saves: here the critic's saves are the ones beside them that ``--critic-save`` wrote).

``--kl-coef`` is taken, as miles takes it: the policy's GAE rewards are shaped by ``-kl_coef * KL``
(``trainer/gae.py``). The critic's returns are not: its group computes neither the policy's nor the
reference's logprobs, so its value targets are those of miles' critic-only steps (the reward alone).
"""

from __future__ import annotations

from miles_disagg.types import ConfigError

CRITIC_SUFFIX = "_critic"


def uses_critic(config) -> bool:
    """Whether the run (a ``RunConfig``) trains a critic: ``--advantage-estimator ppo`` with a trainer."""
    return config.train.advantage_estimator == "ppo" and not config.rollout.debug_rollout_only


def critic_lr(config) -> float:
    return config.train.lr if config.critic.critic_lr is None else config.critic.critic_lr


def critic_save_dir(config) -> str | None:
    """``--critic-save``, else ``--save`` + ``_critic`` (None: the run does not save)."""
    if config.critic.critic_save:
        return config.critic.critic_save
    return config.train.save.rstrip("/") + CRITIC_SUFFIX if config.train.save else None


def critic_load_dir(config) -> str | None:
    """``--critic-load``, else ``--load`` + ``_critic`` (None: the critic starts from a new value head)."""
    if config.critic.critic_load:
        return config.critic.critic_load
    return config.train.load.rstrip("/") + CRITIC_SUFFIX if config.train.load else None


def check_critic_rules(config) -> None:
    """``ConfigError`` for the first combination a run with a critic cannot take."""
    if config.train.advantage_estimator != "ppo":
        return
    train, estimator = config.train, "--advantage-estimator ppo"
    if train.train_backend == "megatron":
        raise ConfigError(f"{estimator}: the critic trains on --train-backend fsdp only here (no Megatron value "
                          "model): add --train-backend fsdp", ("--advantage-estimator", "--train-backend"))
    if config.cluster.colocate:
        raise ConfigError(f"{estimator}: the critic has GPUs of its own and does not take turns with colocated "
                          "engines: drop --colocate", ("--advantage-estimator", "--colocate"))
    if train.max_trainer_restarts:
        raise ConfigError(f"{estimator} with --max-trainer-restarts: a restart replaces the policy's group only, and "
                          "the critic would not follow it back to the save: drop --max-trainer-restarts",
                          ("--advantage-estimator", "--max-trainer-restarts"))
    _check_critic_batches(config)


def _check_critic_batches(config) -> None:
    """Every global batch deals evenly over the critic's ranks, as over the policy's."""
    rollout = config.rollout
    ranks, batch = config.cluster.num_critic_gpus, config.train.global_batch_size
    if batch is None and rollout.rollout_batch_size is not None:  # one optimizer step over the whole rollout
        batch = rollout.rollout_batch_size * rollout.n_samples_per_prompt
    if batch is not None and batch % ranks:
        raise ConfigError(f"--global-batch-size {batch} does not divide over the critic's {ranks} ranks "
                          "(--critic-num-nodes x --critic-num-gpus-per-node)",
                          ("--global-batch-size", "--critic-num-nodes", "--critic-num-gpus-per-node"))
