"""What the engine manager will start, decided without starting anything.

The manager (:mod:`miles_disagg.fleet.manager`) and ``--dry-run``
(:mod:`miles_disagg.loop.dry_run`) both take their engine specs and router settings from
here, so the plan a dry run prints is the launch a run performs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from miles_disagg.weights.location import with_relay
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import RolloutConfig, WeightUpdateConfig
from miles_disagg.engines.launch import EngineSpec
from miles_disagg.weights.publisher import FilterChoice

ROUTER_RETRY_AFTER_S = 0.2
BUILTIN_DELTA_FILTERS = ("byteplane", "none")
"""What the built-in engine reads (and announces under ``/get_server_info`` ``miles_disagg``)."""
BUILTIN_MAX_RUNNING_REQUESTS = 64


def resolve_backend(choice: str) -> tuple[str, str]:
    """``--rollout-backend`` on this machine: (backend, why)."""
    if choice != "auto":
        return choice, f"--rollout-backend {choice}"
    import torch

    if torch.cuda.is_available():
        return "sglang", "--rollout-backend auto: a CUDA device is present"
    return "builtin", "--rollout-backend auto: no CUDA device on this machine"


def local_checkpoint_root(config: EngineManagerConfig) -> Path:
    return Path(config.weights.update_weight_local_checkpoint_dir or Path(config.run_dir) / "rollout-checkpoints")


def engine_specs(config: EngineManagerConfig, engines: Sequence[Sequence[int]], backend: str) -> list[EngineSpec]:
    """One spec per managed engine (``engines``: each engine's bundle positions). The node's
    address (when the job spans nodes) and the base GPU id are filled in where the engine is placed."""
    from miles_disagg.net.netbind import bind_host

    root = local_checkpoint_root(config)
    store = config.weights.update_weight_disk_dir
    per_engine = config.rollout.sglang_server_concurrency or BUILTIN_MAX_RUNNING_REQUESTS
    sglang_args = dict(config.sglang_args)
    if config.cluster.colocate and backend == "sglang":
        sglang_args.setdefault("enable-memory-saver", True)  # what /release_memory_occupation needs on GPU
    routing = config.returns_routing(backend)
    if routing and backend == "sglang":
        sglang_args["enable-return-routed-experts"] = True  # SGLang's flag (routing replay)
    builtin_args = ("--enable-return-routed-experts",) if routing and backend == "builtin" else ()
    if config.lora_base_dir and backend == "builtin":  # the run's adapter versions, served beside the base
        builtin_args += ("--enable-lora", *adapter_base_args(config))
    lora, agent_args = sglang_lora(config) if backend == "sglang" else (None, ())
    base_from_store = config.weights.rollout_base_from_store  # each node fetches version 0 from the store
    return [EngineSpec(backend=backend, name=f"engine-{index}",
                       model_path=root / f"engine-{index}.base" if base_from_store else Path(config.model_path),
                       base_from_store=base_from_store,
                       log_dir=Path(config.run_dir) / "logs", local_checkpoint_dir=root / f"engine-{index}",
                       store_dir=with_relay(store, config.weights.relay_of(config.weights.region_of(index))) if store else None,
                       region=config.weights.region_of(index), host=bind_host(spans_nodes=config.spans_nodes),
                       tp_size=len(bundles), dtype=config.rollout.engine_dtype, seed=config.seed + index,
                       max_running_requests=per_engine,
                       pre_read_hook=config.weights.sglang_custom_pull_weights_pre_read_hook,
                       sglang_args=sglang_args, extra_args=builtin_args, lora=lora, agent_args=agent_args)
            for index, bundles in enumerate(engines)]


def sglang_lora(config: EngineManagerConfig):
    """``(LoraServing, agent args)`` of managed SGLang engines serving the run's adapter versions: SGLang
    starts with ``--enable-lora`` and its group, the agent in front of it with ``--lora-base-dir`` (it
    loads each adapter version and pins every ``/generate`` to one); ``(None, ())`` otherwise."""
    from miles_disagg.engines.agent.adapters import DEFAULT_KEEP
    from miles_disagg.engines.sglang import LoraServing

    if not config.lora_base_dir:
        return None, ()
    loaded = DEFAULT_KEEP + 1  # the resident versions and the next one, loaded beside them
    lora = LoraServing(max_lora_rank=config.lora_rank, target_modules=config.lora_targets,
                       max_loaded_loras=loaded, max_loras_per_batch=loaded)
    return lora, (*adapter_base_args(config), "--lora-resident-versions", str(DEFAULT_KEEP))


def adapter_base_args(config: EngineManagerConfig) -> tuple[str, ...]:
    """Where a managed engine (or its agent) finds the adapter chain's version 0: the object store's,
    fetched beside its own local checkpoint, or the path beside a directory store."""
    if config.lora_base_from_store:
        return ("--lora-base-from-store",)
    return ("--lora-base-dir", str(config.lora_base_dir))


def launch_specs(config: EngineManagerConfig, engines: Sequence[Sequence[int]]) -> list[EngineSpec]:
    """:func:`engine_specs` for the backend ``--rollout-backend`` resolves to on this machine."""
    return engine_specs(config, engines, resolve_backend(config.rollout.rollout_backend)[0])


def managed_backend(rollout: RolloutConfig) -> str | None:
    """The backend of the engines this job launches; None when it launches none (attached
    engines, a rollout service)."""
    if rollout.rollout_external or rollout.rollout_service_url:
        return None
    return resolve_backend(rollout.rollout_backend)[0]


@dataclass(frozen=True)
class RouterPlan:
    """The router in front of the engines: the job's version-aware router, or sglang-router."""

    kind: str
    """``builtin`` or ``sglang``."""
    port: int | None
    """``--sglang-router-port``; None: a free port."""
    health_check_interval_s: float = 1.0
    policy: str | None = None
    """sglang-router only: ``--sglang-router-policy``."""
    extra_args: tuple[str, ...] = field(default=())

    def argv(self, *, host: str, port: int | str, workers: Sequence[str] = ()) -> list[str]:
        if self.kind == "sglang":
            from miles_disagg.router.sglang_router import sglang_router_command

            return sglang_router_command(host=host, port=port, workers=workers, policy=self.policy)
        from miles_disagg.router.launch import router_command

        return router_command(host=host, port=port, workers=workers, health_check_interval_s=self.health_check_interval_s,
                              retry_after_s=ROUTER_RETRY_AFTER_S, extra_args=self.extra_args)


def router_plan(config: EngineManagerConfig) -> RouterPlan:
    rollout = config.rollout
    if rollout.router == "sglang":
        return RouterPlan("sglang", rollout.sglang_router_port, policy=rollout.sglang_router_policy)
    return RouterPlan("builtin", rollout.sglang_router_port, rollout.rollout_health_check_interval,
                      extra_args=("--health-check-timeout", str(rollout.rollout_health_check_timeout),
                                  "--health-failure-threshold", str(rollout.rollout_health_check_failure_threshold),
                                  "--router-workers", str(rollout.router_workers)))


def delta_filter_choice(weights: WeightUpdateConfig, rollout: RolloutConfig, *, backend: str | None,
                        num_engines: int, attached: Sequence[list[str] | None] | None = None) -> FilterChoice:
    """Resolve ``--update-weight-delta-filter`` (``auto``) for the store's consumers.

    Managed built-in engines read byte planes; managed SGLang engines count as SGLang consumers
    (the reference's topology, whose store stock SGLang's own ``/pull_weights`` may read);
    attached engines count by what they announce (``attached``: per engine, from
    ``/agent_info`` or ``/get_server_info``; None while unknown); a rollout service's replicas
    are not known here."""
    from miles_disagg.weights.publisher import choose_delta_filter

    if rollout.rollout_service_url:
        consumers = [(f"the rollout service at {rollout.rollout_service_url}", None)]
    elif rollout.rollout_external:
        addrs = rollout.rollout_external_engine_addrs
        announced = list(attached) if attached is not None else [None] * len(addrs)
        consumers = [(f"attached engine {addr}" + ("" if filters else " (announces no format)"), filters)
                     for addr, filters in zip(addrs, announced)]
    elif backend == "builtin":
        consumers = [(f"built-in engine {i}", list(BUILTIN_DELTA_FILTERS)) for i in range(num_engines)]
    else:
        consumers = [(f"SGLang engine {i}", None) for i in range(num_engines)]
    return choose_delta_filter(weights.update_weight_delta_filter, consumers)


def unused_sglang_args(config: EngineManagerConfig, backend: str | None) -> str | None:
    """A note when ``--sglang-*`` options were given but no managed SGLang server will read them."""
    if not config.sglang_args or backend == "sglang":
        return None
    names = ", ".join(f"--sglang-{name}" for name in config.sglang_args)
    where = "attached engines were launched with their own options" if config.rollout.rollout_external else \
        "the rollout service's replicas have their own options" if config.rollout.rollout_service_url else \
        "the built-in engines do not run SGLang"
    return f"{names}: SGLang server options, not used: {where}"
