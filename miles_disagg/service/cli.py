"""``miles-disagg serve gateway|replica|local|ray``: the external rollout service.

* ``gateway``: the version-aware router in service mode (one endpoint; replicas register).
* ``replica``: one engine (``--engine builtin|sglang|url:http://H:P``) reconciled against
  ``--store`` and reported to ``--gateway``.
* ``local``: a gateway on ``--host:--port`` plus ``--replicas`` replica processes; runs until
  SIGINT/SIGTERM. A version published into ``--store`` reaches every replica by itself.
* ``ray``: a gateway plus replicas as Ray actors on the Ray cluster at ``--address`` (not the
  trainer's), autoscaled between ``--min-replicas`` and ``--max-replicas`` from the gateway's load;
  ``--replica-resource NAME`` keeps replicas on nodes offering that resource. On a cluster of
  several nodes ``--host`` must be an address the other nodes reach (loopback: exit 2).

Each prints one line once it is serving; logs go to stderr. Bad settings exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.config.commands import ServerFlags, action_config, add_actions
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.types import ConfigError
from miles_disagg.weights.location import is_url, normalize_store

DEFAULT_GATEWAY_PORT = 30090
ENGINE_FLAG = "--engine"
PORT_HELP = "HTTP port (0: any free port)."
BASE_DIR_HELP = "The base checkpoint (version 0); not with --base-from-store."
LORA_BASE_DIR_FLAG = "--lora-base-dir"
LORA_BASE_DIR_HELP = ("Serve a run's LoRA adapter versions: the adapter chain's version 0 (for a directory "
                      "store, the run's --update-weight-disk-dir plus .lora-v0); the run writes it as it starts.")


@dataclass(kw_only=True)
class GatewayCommand(ServerFlags):
    """the one endpoint: version-aware router in service mode"""

    port: int = flag(DEFAULT_GATEWAY_PORT, PORT_HELP)
    health_check_interval: float = flag(0.5, "Seconds between health checks of every replica.", metavar="S")
    health_check_timeout: float = flag(2.0, "Timeout of one health probe.", metavar="S")
    retry_after_s: float = flag(1.0, "Wait advised with 409/503 answers.", metavar="S")
    request_timeout: float = flag(600.0, "Read timeout of a proxied generation request.", metavar="S")
    heartbeat_timeout: float = flag(3.0, "A replica silent this long is out of routing.", metavar="S")
    forget_after: float = flag(60.0, "A replica silent this long is removed.", metavar="S")
    lora_base_dir: Path | None = flag(None, LORA_BASE_DIR_HELP + " Only replicas of this chain are taken.",
                                      metavar="DIR")


@dataclass(kw_only=True)
class ReplicaFlags:
    """How every replica runs its engine and follows the store (``replica``, ``local``, ``ray``)."""

    engine: str = flag("builtin", "builtin | sglang | url:http://HOST:PORT (an engine someone else runs).")
    poll_interval: float = flag(1.0, "Seconds between looks at the store's LATEST (POST /wake looks now).",
                                metavar="S")
    heartbeat_interval: float = flag(1.0, "Seconds between heartbeats to the gateway.", metavar="S")
    pause_mode: str = flag("retract", "Activation pause mode (retract: in-flight requests resume on the new "
                                      "weights).", choices=("retract", "in_place", "abort"))
    max_restages: int = flag(2, "Newer versions staged straight away before activating.", metavar="N")
    pre_read_hook: str | None = flag(None, "hook(source_dir, target_version) run before a pull reads the store.",
                                     metavar="MODULE:FUNCTION")
    phase_hook: str | None = flag(None, "hook(phase, version) at staging/staged/paused/activated/failed.",
                                  metavar="MODULE:FUNCTION")
    engine_args: list[str] = flag([], "Extra engine command-line argument (repeatable; --engine-arg=--flag=value).",
                                  name="--engine-arg", metavar="ARG", repeat="append")
    drain_timeout: float = flag(30.0, "Longest wait for in-flight requests at shutdown.", metavar="S")
    base_from_store: bool = flag(False, "Each replica fetches the base from the object store (put there by the "
                                        "trainer's --rollout-base-from-store or `weights publish --base-in-store`) "
                                        "onto its own node, instead of reading --base-dir.")
    lora_base_dir: Path | None = flag(None, LORA_BASE_DIR_HELP + " Replicas run built-in engines with "
                                      "--enable-lora and load each version beside the base, with no pause.",
                                      metavar="DIR")

    def __post_init__(self) -> None:
        parse_engine(self.engine)
        if self.lora_base_dir is not None and self.engine != "builtin":
            raise ConfigError(f"{LORA_BASE_DIR_FLAG} with {ENGINE_FLAG} {self.engine}: the service's replicas serve "
                              "adapter versions on built-in engines they launch; use --engine builtin (SGLang serves "
                              "a run's adapters behind `miles-disagg agent --lora-base-dir`, attached to the run)",
                              flags=(LORA_BASE_DIR_FLAG, ENGINE_FLAG))

    def replica_options(self):
        from miles_disagg.service.launch import ReplicaOptions

        return ReplicaOptions(engine=self.engine, poll_interval_s=self.poll_interval,
                              heartbeat_interval_s=self.heartbeat_interval, pause_mode=self.pause_mode,
                              max_restages=self.max_restages, pre_read_hook=self.pre_read_hook,
                              phase_hook=self.phase_hook, engine_args=tuple(self.engine_args),
                              drain_timeout_s=self.drain_timeout, base_from_store=self.base_from_store,
                              lora_base_dir=_absolute(self.lora_base_dir))


@dataclass(kw_only=True)
class ReplicaCommand(ServerFlags, ReplicaFlags):
    """one engine that follows the version store"""

    port: int = flag(0, PORT_HELP)
    store: str = flag(REQUIRED, "The version store (the trainer's --update-weight-disk-dir): a directory or s3://bucket/prefix.")
    gateway: str = flag(REQUIRED, "Gateway URL to register with.")
    base_dir: Path | None = flag(None, BASE_DIR_HELP)
    local_checkpoint_dir: Path = flag(REQUIRED, "Host-local checkpoint (A/B slots).")
    replica_id: str | None = flag(None, "Stable replica name (default: host:port of the control API).")
    log_dir: Path | None = flag(None, "Engine logs (default: next to the local checkpoint).")
    tp_size: int = flag(1, "SGLang tensor-parallel size.")
    base_gpu_id: int = flag(0, "SGLang's first GPU.")
    dtype: str = flag("auto", "Weight dtype, passed to the engine's --dtype.")


@dataclass(kw_only=True)
class PoolFlags(ServerFlags, ReplicaFlags):
    """A gateway plus replicas (``local``, ``ray``)."""

    port: int = flag(DEFAULT_GATEWAY_PORT, PORT_HELP)
    store: str = flag(REQUIRED, "The version store replicas follow: a directory or s3://bucket/prefix.")
    base_dir: Path | None = flag(None, BASE_DIR_HELP)
    work_dir: Path | None = flag(None, "Local checkpoints and logs (default: a temp dir).")
    heartbeat_timeout: float = flag(3.0, "A replica silent this long is out of routing.", metavar="S")

    def work_dir_or_temp(self) -> Path:
        return self.work_dir or Path(tempfile.mkdtemp(prefix="miles-disagg-service-"))


@dataclass(kw_only=True)
class LocalCommand(PoolFlags):
    """a gateway and N replica processes on this machine"""

    replicas: int = flag(2, "Replica processes.", metavar="N")


@dataclass(kw_only=True)
class RayCommand(PoolFlags):
    """a gateway and autoscaled replicas as Ray actors"""

    address: str | None = flag(None, "The rollout Ray cluster (default: start a local one).")
    min_replicas: int = flag(1, "Never fewer replicas.", metavar="N")
    max_replicas: int = flag(4, "Never more replicas.", metavar="N")
    target_in_flight: float = flag(8.0, "Requests in flight per replica the pool is sized for.", metavar="N")
    scale_interval: float = flag(2.0, "Seconds between scaling decisions.", metavar="S")
    scale_down_delay: float = flag(30.0, "How long a smaller count must be wanted before replicas are removed.",
                                   metavar="S")
    num_gpus_per_replica: float = flag(0.0, "GPUs each replica actor reserves.", metavar="N")
    replica_resource: str | None = flag(None, "Place replicas only on nodes offering this Ray custom resource "
                                              "(as rollout hosts are commonly labelled).", metavar="NAME")


ROLES = {"gateway": GatewayCommand, "replica": ReplicaCommand, "local": LocalCommand, "ray": RayCommand}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_actions(parser, "serve_command", "ROLE", ROLES)


def run(args: argparse.Namespace) -> int:
    command = action_config(args, "serve_command", ROLES)
    command.configure_logging()
    command.export_keys()  # children (gateway, replicas, engines) get the keys through the environment
    return {"gateway": _run_gateway, "replica": _run_replica, "local": _run_local,
            "ray": _run_ray}[args.serve_command](command)


def _base_dir(command: ReplicaCommand | PoolFlags) -> Path | None:
    """``--base-dir``, checked; ``None`` with ``--base-from-store`` (each replica fetches the store's base)."""
    path = command.base_dir
    if command.base_from_store:
        if path is not None:
            raise ConfigError("give --base-dir or --base-from-store, not both", flags=("--base-dir", "--base-from-store"))
        if not is_url(command.store):
            raise ConfigError(f"--base-from-store: only an object store holds a base, not --store {command.store!r}",
                              flags=("--base-from-store", "--store"))
        return None
    if path is None:
        raise ConfigError("--base-dir is required (the base checkpoint), or --base-from-store to fetch it from an "
                          "object store", flags=("--base-dir",))
    if not (path / "config.json").is_file():
        raise ConfigError(f"--base-dir {str(path)!r} is not a checkpoint directory (no config.json)", flags=("--base-dir",))
    return path.resolve()


def _absolute(path: Path | None) -> Path | None:
    return None if path is None else Path(os.path.abspath(path))


def _run_gateway(command: GatewayCommand) -> int:
    import uvicorn

    from miles_disagg.router.config import RouterConfig
    from miles_disagg.service.gateway import GatewayConfig, create_gateway_app
    from miles_disagg.service.replica import listen_socket

    try:
        config = GatewayConfig(
            router=RouterConfig(health_check_interval_s=command.health_check_interval,
                                health_check_timeout_s=command.health_check_timeout,
                                retry_after_s=command.retry_after_s, request_timeout_s=command.request_timeout),
            heartbeat_timeout_s=command.heartbeat_timeout, forget_after_s=command.forget_after,
            lora_base_dir=str(_absolute(command.lora_base_dir)) if command.lora_base_dir else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    sock = listen_socket(command.host, command.port, backlog=2048)
    server = uvicorn.Server(uvicorn.Config(create_gateway_app(config, command.guard()), log_level=command.log_level))
    print(f"miles-disagg serve gateway listening on http://{command.host}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])
    return 0


def _run_replica(command: ReplicaCommand) -> int:
    from miles_disagg.engines.launch import EngineSpec
    from miles_disagg.service.reconciler import ReconcileConfig
    from miles_disagg.service.replica import Replica, ReplicaConfig, load_phase_hook

    base_dir = _base_dir(command)
    kind, attach_url = parse_engine(command.engine)
    load_phase_hook(command.phase_hook)  # fail before anything starts
    local = command.local_checkpoint_dir
    chain = _absolute(command.lora_base_dir)
    lora_args = ("--enable-lora", "--lora-base-dir", str(chain)) if chain is not None else ()
    try:
        engine = EngineSpec(backend="builtin" if kind == "url" else kind,
                            model_path=base_dir or local.parent / f"{local.name}.base",
                            base_from_store=base_dir is None and kind != "url",
                            local_checkpoint_dir=local, store_dir=normalize_store(command.store, "--store"),
                            log_dir=command.log_dir or local.parent / f"{local.name}.logs", host=command.host,
                            pre_read_hook=command.pre_read_hook, extra_args=lora_args + tuple(command.engine_args),
                            tp_size=command.tp_size, base_gpu_id=command.base_gpu_id, dtype=command.dtype)
        config = ReplicaConfig(
            replica_id=command.replica_id, store_dir=normalize_store(command.store, "--store"), gateway_url=command.gateway, engine=engine,
            attach_url=attach_url,
            host=command.host, port=command.port, poll_interval_s=command.poll_interval,
            heartbeat_interval_s=command.heartbeat_interval, drain_timeout_s=command.drain_timeout,
            reconcile=ReconcileConfig(pause_mode=command.pause_mode, max_restages=command.max_restages),
            phase_hook=command.phase_hook, guard=command.guard(), lora_base_dir=chain)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    replica = Replica(config)
    print(f"miles-disagg serve replica {replica.replica_id}: control API {replica.control_url}", flush=True)
    replica.run()
    return 0


def parse_engine(value: str) -> tuple[str, str | None]:
    """``(kind, attach_url)`` from ``--engine builtin|sglang|url:http://H:P``; ``ConfigError`` naming the flag otherwise."""
    if value in ("builtin", "sglang"):
        return value, None
    if value.startswith("url:"):
        from miles_disagg.router.registry import normalize_url
        from miles_disagg.types import InvalidInput

        try:
            return "url", normalize_url(value[len("url:"):])
        except InvalidInput as exc:
            raise ConfigError(f"{ENGINE_FLAG} {value!r}: {exc}", flags=(ENGINE_FLAG,)) from None
    raise ConfigError(f"{ENGINE_FLAG} must be builtin, sglang or url:http://HOST:PORT, got {value!r}", flags=(ENGINE_FLAG,))


def _run_local(command: LocalCommand) -> int:
    from miles_disagg.service.local import launch_local_service

    base_dir = _base_dir(command)
    options = command.replica_options()
    work_dir = command.work_dir_or_temp()
    service = launch_local_service(normalize_store(command.store, "--store"), base_dir, work_dir=work_dir,
                                   num_replicas=command.replicas, port=command.port, host=command.host, replica=options,
                                   heartbeat_timeout_s=command.heartbeat_timeout)
    from miles_disagg.service.local import awaits_adapter_chain

    ready = (f"replicas start serving once the run writes the adapter chain's version 0 at {options.lora_base_dir}"
             if awaits_adapter_chain(options) else "replicas ready")
    print(f"miles-disagg serve local: gateway {service.url}, {command.replicas} {ready} (work dir {work_dir})",
          flush=True)
    _wait_for_signal()
    service.stop()
    return 0


def _run_ray(command: RayCommand) -> int:
    from miles_disagg.service.ray_pool import RayServiceConfig, run_ray_service
    from miles_disagg.service.scaling import ScalingConfig

    base_dir = _base_dir(command)
    try:
        scaling = ScalingConfig(min_replicas=command.min_replicas, max_replicas=command.max_replicas,
                                target_in_flight_per_replica=command.target_in_flight,
                                scale_down_delay_s=command.scale_down_delay)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    config = RayServiceConfig(store_dir=normalize_store(command.store, "--store"), base_dir=base_dir,
                              work_dir=command.work_dir_or_temp(), host=command.host, port=command.port, scaling=scaling,
                              replica=command.replica_options(), num_gpus_per_replica=command.num_gpus_per_replica,
                              scale_interval_s=command.scale_interval, heartbeat_timeout_s=command.heartbeat_timeout,
                              replica_resource=command.replica_resource)
    run_ray_service(config, address=command.address, stop=threading.Event(),
                    on_ready=lambda url: print(f"miles-disagg serve ray: gateway {url}", flush=True))
    return 0


def _on_signal(callback) -> None:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: callback())


def _wait_for_signal() -> None:
    stop = threading.Event()
    _on_signal(stop.set)
    while not stop.wait(1.0):
        pass
