"""``--dry-run``: check what can be checked without starting anything, then describe the launch.

The plan is one JSON-able object: the placement (which bundles the trainer ranks and each
engine get), every process the run would start with its full argv (router, built-in engines,
SGLang servers and their agents), and the delta filter. It is built with the functions the
real launch uses (:mod:`miles_disagg.fleet.plan`, :func:`~miles_disagg.engines.launch.engine_processes`,
:class:`~miles_disagg.fleet.plan.RouterPlan`), so the two cannot drift. Values only known on
the engine's node at launch stay as placeholders (``{host}``, ``{port}``, ...).

Nothing is started and nothing is written; attached engines are asked (briefly) which delta
formats they read. What this machine cannot run but the target machine may (pipeline or
sequence parallelism without CUDA) is reported under ``warnings``, not refused.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import RunConfig
from miles_disagg.config.critic_rules import uses_critic
from miles_disagg.config.lora_rules import describe_lora
from miles_disagg.types import ConfigError, MilesDisaggError

PLACEHOLDERS = {
    "{host}": "the address of the node the engine is placed on",
    "{port}": "a free port on that node, chosen at launch",
    "{agent_port}": "a free port for the engine's agent, chosen at launch",
    "{base_gpu_id}": "the GPU Ray gives the engine's first bundle",
    "{engine_urls}": "the engines' URLs once they answer",
    "{session_port}": "a free port for the session endpoint, chosen at launch (--session-server-port fixes it)",
}
ANNOUNCE_TIMEOUT_S = 5.0


def plan_launch(config: RunConfig) -> dict[str, Any]:
    """The launch plan of ``config``; ``ConfigError`` for what would fail before training starts."""
    from miles_disagg.fleet.plan import resolve_backend, unused_sglang_args
    from miles_disagg.loop.preflight import check_runnable
    from miles_disagg.trainer.placement import plan_layout

    warnings: list[str] = []
    check_runnable(config, warnings)  # every preflight check (loop/preflight_checks.py), the weight hooks included
    rollout = config.rollout
    topology = "service" if rollout.rollout_service_url else "attached" if rollout.rollout_external else "managed"
    with_engines = not rollout.debug_train_only
    layout = plan_layout(config.cluster, external_rollout=topology != "managed" or not with_engines,
                         critic=uses_critic(config))
    warnings += _check_model(config)
    backend, backend_reason = resolve_backend(rollout.rollout_backend) if topology == "managed" else (None, topology)
    manager_config = EngineManagerConfig.from_run(config)
    processes = _router_process(manager_config, layout) if with_engines and topology != "service" else []
    processes += _engine_processes(manager_config, layout, backend) if with_engines and topology == "managed" else []
    attached = _announcements(rollout.rollout_external_engine_addrs, warnings) if topology == "attached" else None
    note = unused_sglang_args(manager_config, backend)
    warnings += [note] if note else []
    return {
        "entry": config.entry,
        "topology": topology,
        "train_backend": config.train.train_backend,
        "lora": describe_lora(config),  # None: full fine-tuning
        "update_weight_transfer_mode": config.weights.update_weight_transfer_mode,
        "ray": {"address": os.environ.get("RAY_ADDRESS") or "local", "bundles": layout.num_bundles},
        "placement": _placement(config, layout),
        "rollout_backend": {"backend": backend, "reason": backend_reason},
        "processes": processes,
        "delta_filter": _delta_filter(config, backend, len(layout.engines), attached),
        "initial_weights": _initial_weights(config),
        **({"sessions": _sessions(rollout)} if rollout.use_session_server else {}),
        "placeholders": PLACEHOLDERS,
        "warnings": warnings,
    }


def _sessions(rollout) -> dict[str, Any]:
    """``--use-session-server``: the session endpoint the rollout manager serves (rollout/sessions/app.py)."""
    port = rollout.session_server_port[0] if rollout.session_server_port else "{session_port}"
    return {"address": f"http://127.0.0.1:{port}", "agent": rollout.custom_agent_function_path,
            "tito_model": rollout.tito_model, "allowed_append_roles": sorted(set(rollout.tito_allowed_append_roles)
                                                                              | {"tool"}),
            "routes": ["POST /sessions", "GET /sessions/{id}", "DELETE /sessions/{id}",
                       "POST /sessions/{id}/v1/chat/completions"]}


def _check_model(config: RunConfig) -> list[str]:
    """Megatron: the checkpoint's shape must split over TP/PP (an error); what needs hardware
    this machine lacks is a warning."""
    train = config.train
    path = Path(str(train.hf_checkpoint))
    if train.hf_checkpoint is None:
        raise ConfigError("--hf-checkpoint is required", ("--hf-checkpoint",))
    if not path.is_dir():
        if train.hf_checkpoint_init != "none":
            return [f"--hf-checkpoint {path} does not exist yet: the run creates a random {train.hf_checkpoint_init}"]
        raise ConfigError(f"--hf-checkpoint {str(path)!r} is not a local directory", ("--hf-checkpoint",))
    if train.train_backend != "megatron":
        return []
    from miles_disagg.trainer.megatron.convert import ModelShape
    from miles_disagg.trainer.megatron.model import check_layout_support
    from miles_disagg.config.model_args import load_hf_config

    ModelShape.from_hf_config(load_hf_config(path)).check_parallel(train.tensor_model_parallel_size,
                                                                     train.pipeline_model_parallel_size,
                                                                     train.expert_model_parallel_size)
    try:
        check_layout_support(train)
    except ConfigError as exc:
        return [f"on this machine: {exc}"]
    return []


def _placement(config: RunConfig, layout) -> dict[str, Any]:
    from miles_disagg.trainer.placement import node_of

    per_node = config.cluster.num_gpus_per_node

    def where(position: int) -> dict[str, int]:
        if per_node is None:
            return {"bundle": position}
        node, gpu = node_of(position, per_node)
        return {"bundle": position, "node": node, "gpu": gpu}

    return {
        "num_bundles": layout.num_bundles,
        "order": "bundles sorted by (node, GPU id); node/gpu assume nodes of --num-gpus-per-node GPUs filled in order",
        "trainer": [{"rank": rank, **where(p)} for rank, p in enumerate(layout.trainer)],
        **({"critic": [{"rank": rank, **where(p)} for rank, p in enumerate(layout.critic)]} if layout.critic else {}),
        "engines": [{"engine": i, "bundles": [where(p) for p in bundles]} for i, bundles in enumerate(layout.engines)],
    }


def _router_process(config: EngineManagerConfig, layout) -> list[dict[str, Any]]:
    from miles_disagg.fleet.plan import router_plan

    plan = router_plan(config)
    workers = ["{engine_urls}"] if plan.kind == "sglang" else []  # the built-in router learns them by /add_worker
    argv = plan.argv(host="127.0.0.1", port=plan.port or "{port}", workers=workers)
    return [{"role": "router" if plan.kind == "builtin" else "sglang-router", "argv": argv,
             "log": str(Path(config.run_dir) / "logs" / "router.log")}]


def _engine_processes(config: EngineManagerConfig, layout, backend: str) -> list[dict[str, Any]]:
    from miles_disagg.engines.launch import engine_processes
    from miles_disagg.fleet.plan import engine_specs

    planned = []
    for index, spec in enumerate(engine_specs(config, layout.engines, backend)):
        placed = dataclasses.replace(spec, host="{host}", base_gpu_id="{base_gpu_id}")
        for process in engine_processes(placed, port="{port}", agent_port="{agent_port}"):
            planned.append({"role": process.role, "engine": index, "bundles": list(layout.engines[index]),
                            "argv": process.argv, "log": str(process.log_path)})
    return planned


def _announcements(addrs: list[str], warnings: list[str]) -> list[list[str] | None]:
    from miles_disagg.engines.client import EngineClient

    found = []
    for addr in addrs:
        try:
            with EngineClient(f"http://{addr}", timeout_s=ANNOUNCE_TIMEOUT_S) as client:
                found.append(client.announced_delta_filters())
        except (MilesDisaggError, OSError) as exc:
            warnings.append(f"attached engine {addr} did not answer ({type(exc).__name__}); counted as announcing "
                            "no delta format")
            found.append(None)
    return found


def _delta_filter(config: RunConfig, backend: str | None, num_engines: int, attached) -> dict[str, Any]:
    from miles_disagg.fleet.plan import delta_filter_choice

    if config.weights.update_weight_transfer_mode != "disk-delta":
        return {"filter": None, "reason": "broadcast: nothing is published to a store"}
    choice = delta_filter_choice(config.weights, config.rollout, backend=backend, num_engines=num_engines,
                                 attached=attached)
    return {"filter": choice.filter, "reason": choice.reason}


def _initial_weights(config: RunConfig) -> str:
    from miles_disagg.trainer.checkpoint import find_latest
    from miles_disagg.trainer.torch_dist import initial_checkpoint

    found = find_latest(config.train.load) if config.train.load else None
    if found is not None:
        return f"resume from {found[0]}"
    start = initial_checkpoint(config.train.load, config.train.ref_load, resuming=False)
    return f"{start[1]} {start[0]} (Megatron torch_dist)" if start else f"--hf-checkpoint {config.train.hf_checkpoint}"
