"""One config object per actor, built once from the resolved :class:`RunConfig`.

An actor receives its own config, never the whole run: the engine manager, the trainer group
(and its ranks) and the rollout manager each take one of these. ``from_run`` is the only
place that knows which run-wide values each actor needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from miles_disagg.config.components import ClusterConfig, RolloutConfig, RunConfig, WeightUpdateConfig
from miles_disagg.config.lora_rules import adapter_base_dir, adapter_base_in_store, serves_adapters

from miles_disagg.config.training import TrainConfig


@dataclass(frozen=True, kw_only=True)
class EngineManagerConfig:
    """What the engine manager needs: which engines, where their weights come from, the router."""

    cluster: ClusterConfig
    rollout: RolloutConfig
    weights: WeightUpdateConfig
    model_path: str
    """The base checkpoint (version 0) every engine starts from."""
    run_dir: str
    """Logs go to ``run_dir/logs``; local checkpoints default to ``run_dir/rollout-checkpoints``."""
    seed: int = 0
    """Engine ``i`` samples with ``seed + i``."""
    sglang_args: dict[str, Any] = field(default_factory=dict)
    """``--sglang-*`` passthrough for managed SGLang servers."""
    spans_nodes: bool = False
    """The job runs on more than one node: managed servers bind the node IP instead of loopback
    (:func:`miles_disagg.net.netbind.bind_host`, the one place that decides)."""
    moe: bool = False
    """The checkpoint is a mixture-of-experts model (its config.json names experts)."""
    use_rollout_routing_replay: bool = False
    """Engines start with ``--enable-return-routed-experts`` (see :mod:`miles_disagg.config.routing_replay`)."""
    lora_base_dir: str | None = None
    """The run's engines serve its LoRA adapter versions, whose chain starts at this directory
    (:func:`miles_disagg.config.lora_rules.serves_adapters`)."""
    lora_base_from_store: bool = False
    """With ``lora_base_dir``: the chain's version 0 is in the object store (the trainer's copy at
    ``lora_base_dir`` is no engine's): each engine fetches it onto its node (``--lora-base-from-store``)."""
    lora_rank: int = 0
    """With ``lora_base_dir``: the adapters' rank (managed SGLang engines start with ``--max-lora-rank``)."""
    lora_targets: tuple[str, ...] = ()
    """With ``lora_base_dir``: the modules adapted (SGLang's ``--lora-target-modules``)."""

    @classmethod
    def from_run(cls, config: RunConfig) -> "EngineManagerConfig":
        from miles_disagg.config.routing_replay import moe_routing_shape

        return cls(cluster=config.cluster, rollout=config.rollout, weights=config.weights,
                   model_path=str(config.train.hf_checkpoint), run_dir=str(config.tracking.run_dir),
                   seed=config.train.seed, sglang_args=dict(config.sglang_args),
                   moe=moe_routing_shape(config.train.hf_checkpoint) is not None,
                   use_rollout_routing_replay=config.train.use_rollout_routing_replay,
                   lora_base_dir=_lora_base_dir(config), lora_rank=config.train.lora_rank,
                   lora_targets=_lora_targets(config), lora_base_from_store=adapter_base_in_store(config))

    def returns_routing(self, backend: str) -> bool:
        """Whether managed engines of ``backend`` start with ``--enable-return-routed-experts``."""
        from miles_disagg.config.routing_replay import engines_return_routing

        return engines_return_routing(moe=self.moe, replay=self.use_rollout_routing_replay, backend=backend)


@dataclass(frozen=True, kw_only=True)
class TrainerGroupConfig:
    """What every trainer rank needs: the model, the optimizer and loss, and how it publishes."""

    train: TrainConfig
    weights: WeightUpdateConfig
    hf_dir: str
    """The base checkpoint (version 0): what the engines serve, and the form every version takes."""
    train_dir: str = ""
    """The checkpoint the trainer's weights start from (``--train-hf-checkpoint``; default ``hf_dir``)."""
    colocated: bool = False
    """The ranks share GPUs with the engines (``--colocate``)."""
    temperature: float = 1.0
    """Logprobs are taken at the rollout temperature."""
    miles_args: Any = None
    """The run's flags as miles' ``args`` namespace (what a miles-signature post-write hook receives)."""
    initial_checkpoint: tuple[str, str] | None = None
    """``(path, flag)``: a Megatron torch_dist checkpoint the policy starts from (miles' ``--load``
    or ``--ref-load``) instead of the HF checkpoint's weights."""
    lora_base_dir: str | None = None
    """LoRA runs whose engines serve adapter versions: the trainer publishes its adapter, whose
    chain's version 0 it writes here once (None: it publishes the policy's full weights)."""

    @classmethod
    def from_run(cls, config: RunConfig, initial_checkpoint: tuple[str, str] | None = None) -> "TrainerGroupConfig":
        from miles_disagg.config.loader import config_to_namespace

        return cls(train=config.train, weights=config.weights, hf_dir=str(config.train.hf_checkpoint),
                   train_dir=str(config.train.train_hf_checkpoint or config.train.hf_checkpoint),
                   colocated=config.cluster.colocate, temperature=config.rollout.rollout_temperature,
                   miles_args=config_to_namespace(config), initial_checkpoint=initial_checkpoint,
                   lora_base_dir=_lora_base_dir(config))


@dataclass(frozen=True, kw_only=True)
class CriticGroupConfig:
    """What every rank of a PPO critic needs (``--advantage-estimator ppo``): the policy's base
    model (which gets a value head), the policy's batch and optimizer flags, and its own lr and loss."""

    train: TrainConfig
    """The policy's: batch sizes, Adam, gradient clip, seed, --gamma/--lambd, per-token loss."""
    hf_dir: str
    """The full-precision checkpoint the critic's model starts from (a new value head replaces its LM head)."""
    lr: float
    """``--critic-lr`` (default ``--lr``)."""
    lr_warmup_iters: int = 0
    """``--critic-lr-warmup-iters``."""
    value_clip: float = 0.2
    """``--value-clip``."""

    @classmethod
    def from_run(cls, config: RunConfig) -> "CriticGroupConfig":
        from miles_disagg.config.critic_rules import critic_lr

        full_precision = config.train.train_hf_checkpoint or config.train.hf_checkpoint  # an FP8 base: the BF16 one
        return cls(train=config.train, hf_dir=str(full_precision), lr=critic_lr(config),
                   lr_warmup_iters=config.critic.critic_lr_warmup_iters, value_clip=config.critic.value_clip)


@dataclass(frozen=True, kw_only=True)
class RolloutManagerConfig:
    """What the rollout manager needs: prompts, sampling, rewards, staleness and the endpoint."""

    rollout: RolloutConfig
    router_url: str
    """The version-aware router, or the rollout service's endpoint."""
    hf_dir: str
    """Where the tokenizer is read from."""
    seed: int = 0
    run_id: str | None = None
    """Rollout service only: every request's constraint names this run, so a replica still serving
    another run's version of the same number never answers it."""
    routed_experts: tuple[int, int] | None = None
    """MoE: ``(num_hidden_layers, num_experts_per_tok)`` of the routing every engine call asks for
    (``return_routed_experts``) and every sample keeps; None: none asked for."""
    opd_teacher_url: str | None = None
    """``--use-opd``: the teacher's ``/generate`` URL every training sample is scored at (None: no teacher)."""
    opd_teacher_run_keys: bool = False
    use_opd: bool = False
    """``--use-opd``: every training sample is scored by the teacher (``opd_teacher_url``, or the
    ``--opd-teacher-urls`` of ``rollout``)."""
    """The teacher is one the job started: it holds the run's keys, which the requests then carry."""

    @classmethod
    def from_run(cls, config: RunConfig, router_url: str, run_id: str | None = None,
                 backend: str | None = None, job_teacher_url: str | None = None) -> "RolloutManagerConfig":
        """``backend``: the managed engines' (``builtin``/``sglang``); None for attached engines or a service.
        ``job_teacher_url``: the ``/generate`` URL of the OPD teacher the job started (else ``--rm-url``'s)."""
        from miles_disagg.config.routing_replay import rollout_routing_shape

        teacher = (job_teacher_url or config.rollout.rm_url) if config.train.use_opd else None
        return cls(rollout=config.rollout, router_url=router_url, hf_dir=str(config.train.hf_checkpoint),
                   seed=config.train.seed, run_id=run_id, routed_experts=rollout_routing_shape(config, backend),
                   opd_teacher_url=teacher, opd_teacher_run_keys=job_teacher_url is not None,
                   use_opd=config.train.use_opd)


def _lora_base_dir(config: RunConfig) -> str | None:
    if not serves_adapters(config):
        return None
    return adapter_base_dir(config.weights.update_weight_disk_dir, str(config.tracking.run_dir))


def _lora_targets(config: RunConfig) -> tuple[str, ...]:
    from miles_disagg.config.lora_rules import resolve_targets

    train = config.train
    return resolve_targets(train.target_modules, train.exclude_modules) if train.lora_rank else ()
