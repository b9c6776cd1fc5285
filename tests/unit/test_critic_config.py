"""``--advantage-estimator ppo`` and miles' critic flags: defaults (miles'), what is refused (one line
each), and the critic's bundles in the placement (after the trainer's, before the engines')."""

from __future__ import annotations

import pytest

from miles_disagg.config import load_config
from miles_disagg.config.actors import CriticGroupConfig
from miles_disagg.config.components import ClusterConfig
from miles_disagg.config.critic_rules import critic_load_dir, critic_save_dir, uses_critic
from miles_disagg.trainer.placement import plan_layout
from miles_disagg.types import ConfigError

PPO = ["--advantage-estimator", "ppo", "--train-backend", "fsdp", "--actor-num-gpus-per-node", "2"]


def test_miles_critic_flags_and_their_defaults() -> None:
    config, _ = load_config(PPO + ["--lr", "2e-5", "--save", "/ckpt/run1/", "--load", "/ckpt/run1"], "train_async")
    assert uses_critic(config)
    critic = config.critic
    assert (critic.num_critic_only_steps, critic.critic_lr, critic.critic_lr_warmup_iters, critic.value_clip) == \
        (0, None, 0, 0.2)
    assert (config.train.gamma, config.train.lambd) == (1.0, 1.0)
    assert config.cluster.num_critic_gpus == 2  # the actor's, as miles
    assert CriticGroupConfig.from_run(config).lr == 2e-5
    assert critic_save_dir(config) == "/ckpt/run1_critic" and critic_load_dir(config) == "/ckpt/run1_critic"

    config, _ = load_config(PPO + ["--critic-lr", "1e-5", "--critic-lr-warmup-iters", "3", "--value-clip", "0.5",
                                   "--num-critic-only-steps", "2", "--gamma", "0.99", "--lambd", "0.95",
                                   "--critic-num-gpus-per-node", "1", "--critic-save", "/c/save",
                                   "--critic-load", "/c/load"], "train_async")
    group = CriticGroupConfig.from_run(config)
    assert (group.lr, group.lr_warmup_iters, group.value_clip) == (1e-5, 3, 0.5)
    assert (config.critic.num_critic_only_steps, config.train.gamma, config.train.lambd) == (2, 0.99, 0.95)
    assert config.cluster.num_critic_gpus == 1
    assert (critic_save_dir(config), critic_load_dir(config)) == ("/c/save", "/c/load")
    grpo, _ = load_config(["--train-backend", "fsdp"], "train_async")
    assert not uses_critic(grpo) and critic_save_dir(grpo) is None


@pytest.mark.parametrize("extra,flags,message", [
    (["--train-backend", "megatron"], ("--advantage-estimator", "--train-backend"), "fsdp only"),
    (["--colocate"], ("--advantage-estimator", "--colocate"), "drop --colocate"),
    (["--max-trainer-restarts", "1", "--save", "/tmp/x", "--update-weight-transfer-mode", "disk-delta",
      "--hf-checkpoint", "/"], ("--advantage-estimator", "--max-trainer-restarts"),
     "the critic would not follow"),
    (["--critic-num-gpus-per-node", "3", "--global-batch-size", "8"],
     ("--global-batch-size", "--critic-num-nodes", "--critic-num-gpus-per-node"), "critic's 3 ranks"),
])
def test_what_a_critic_cannot_take_is_refused_in_one_line(extra, flags, message) -> None:
    entry = "train" if "--colocate" in extra else "train_async"
    with pytest.raises(ConfigError, match=message) as error:
        load_config(PPO + extra, entry)
    assert error.value.flags == flags and "\n" not in str(error.value)


def test_ppo_takes_kl_coef_as_miles_does() -> None:
    """miles shapes ppo's reward with the KL (``-kl_coef * KL_t`` on each trained token): accepted, and the
    reference is loaded for it."""
    config, _ = load_config(PPO + ["--kl-coef", "0.05", "--kl-loss-type", "k3"], "train_async")
    assert config.train.kl_coef == 0.05 and config.train.needs_reference and uses_critic(config)
    with pytest.raises(ConfigError, match="only one of them can be set"):
        load_config(PPO + ["--kl-coef", "0.05", "--use-kl-loss", "--kl-loss-coef", "0.1"], "train_async")


@pytest.mark.parametrize("extra,message", [
    (["--lambd", "1.5"], "--lambd must be in"), (["--value-clip", "0"], "--value-clip must be > 0"),
    (["--critic-lr", "0"], "--critic-lr must be > 0"), (["--num-critic-only-steps", "-1"], ">= 0"),
    (["--critic-num-nodes", "0"], "--critic-num-nodes must be >= 1"),
])
def test_ranges(extra, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(PPO + extra, "train_async")


def test_the_critic_bundles_come_after_the_trainer_and_before_the_engines() -> None:
    cluster = ClusterConfig(actor_num_gpus_per_node=2, critic_num_gpus_per_node=1, rollout_num_gpus=2)
    layout = plan_layout(cluster, critic=True)
    assert (layout.trainer, layout.critic, layout.engines, layout.num_bundles) == ((0, 1), (2,), ((3,), (4,)), 5)
    assert [layout.is_engine_bundle(p) for p in range(5)] == [False, False, False, True, True]
    assert plan_layout(cluster).critic == () and plan_layout(cluster).num_bundles == 4
    external = plan_layout(ClusterConfig(actor_num_gpus_per_node=2), external_rollout=True, critic=True)
    assert (external.trainer, external.critic, external.num_bundles) == ((0, 1), (2, 3), 4)
