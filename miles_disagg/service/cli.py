"""``miles-disagg serve gateway|replica|local|ray``: the external rollout service.

* ``gateway``: the version-aware router in service mode (one endpoint; replicas register).
* ``replica``: one engine (``--engine builtin|sglang|url:http://H:P``) reconciled against
  ``--store`` and reported to ``--gateway``.
* ``local``: a gateway on ``--host:--port`` plus ``--replicas`` replica processes; runs until
  SIGINT/SIGTERM. A version published into ``--store`` reaches every replica by itself.
* ``ray``: a gateway plus replicas as Ray actors on the Ray cluster at ``--address`` (not the
  trainer's), autoscaled between ``--min-replicas`` and ``--max-replicas`` from the gateway's load.

Each prints one line once it is serving; logs go to stderr. Bad settings exit 2.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import threading
from pathlib import Path

from miles_disagg.types import ConfigError

DEFAULT_GATEWAY_PORT = 30090
ENGINE_FLAG = "--engine"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="serve_command", metavar="ROLE")
    sub.required = True
    _gateway_arguments(sub.add_parser("gateway", help="the one endpoint: version-aware router in service mode"))
    _replica_arguments(sub.add_parser("replica", help="one engine that follows the version store"))
    local = sub.add_parser("local", help="a gateway and N replica processes on this machine")
    _pool_arguments(local)
    local.add_argument("--replicas", type=int, default=2, help="replica processes (default: 2)")
    ray = sub.add_parser("ray", help="a gateway and autoscaled replicas as Ray actors")
    _pool_arguments(ray)
    _ray_arguments(ray)


def _common(parser: argparse.ArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=port, help=f"HTTP port (default: {port}; 0 = any free port)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def _gateway_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, DEFAULT_GATEWAY_PORT)
    parser.add_argument("--health-check-interval", type=float, default=0.5, metavar="S")
    parser.add_argument("--health-check-timeout", type=float, default=2.0, metavar="S")
    parser.add_argument("--retry-after-s", type=float, default=1.0, metavar="S",
                        help="wait advised with 409/503 answers (default: 1.0)")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="S")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="S",
                        help="a replica silent this long is out of routing (default: 3.0)")
    parser.add_argument("--forget-after", type=float, default=60.0, metavar="S",
                        help="a replica silent this long is removed (default: 60)")


def _replica_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default="builtin", help="builtin | sglang | url:http://HOST:PORT (default: builtin)")
    parser.add_argument("--poll-interval", type=float, default=1.0, metavar="S",
                        help="seconds between looks at the store's LATEST (default: 1.0; POST /wake looks now)")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, metavar="S")
    parser.add_argument("--pause-mode", default="retract", choices=("retract", "in_place", "abort"),
                        help="activation pause mode (default: retract; in-flight requests resume on the new weights)")
    parser.add_argument("--max-restages", type=int, default=2, metavar="N",
                        help="newer versions staged straight away before activating (default: 2)")
    parser.add_argument("--pre-read-hook", default=None, metavar="MODULE:FUNCTION",
                        help="hook(source_dir, target_version) run before a pull reads the store")
    parser.add_argument("--phase-hook", default=None, metavar="MODULE:FUNCTION",
                        help="hook(phase, version) at staging/staged/paused/activated/failed")
    parser.add_argument("--engine-arg", dest="engine_args", action="append", default=[], metavar="ARG",
                        help="extra engine command-line argument (repeatable; --engine-arg=--flag=value)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="S")


def _replica_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, 0)
    parser.add_argument("--store", required=True, type=Path, help="the version store (the trainer's --update-weight-disk-dir)")
    parser.add_argument("--gateway", required=True, help="gateway URL to register with")
    parser.add_argument("--base-dir", required=True, type=Path, help="the base checkpoint (version 0)")
    parser.add_argument("--local-checkpoint-dir", required=True, type=Path, help="host-local checkpoint (A/B slots)")
    parser.add_argument("--replica-id", default=None, help="stable replica name (default: host:port of the control API)")
    parser.add_argument("--log-dir", type=Path, default=None, help="engine logs (default: next to the local checkpoint)")
    parser.add_argument("--tp-size", type=int, default=1, help="SGLang tensor-parallel size")
    parser.add_argument("--base-gpu-id", type=int, default=0, help="SGLang's first GPU")
    parser.add_argument("--dtype", default="auto")
    _replica_options(parser)


def _pool_arguments(parser: argparse.ArgumentParser) -> None:
    _common(parser, DEFAULT_GATEWAY_PORT)
    parser.add_argument("--store", required=True, type=Path, help="the version store replicas follow")
    parser.add_argument("--base-dir", required=True, type=Path, help="the base checkpoint (version 0)")
    parser.add_argument("--work-dir", type=Path, default=None, help="local checkpoints and logs (default: a temp dir)")
    parser.add_argument("--heartbeat-timeout", type=float, default=3.0, metavar="S")
    _replica_options(parser)


def _ray_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=None, help="the rollout Ray cluster (default: start a local one)")
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--max-replicas", type=int, default=4)
    parser.add_argument("--target-in-flight", type=float, default=8.0, help="requests in flight per replica")
    parser.add_argument("--scale-interval", type=float, default=2.0, metavar="S")
    parser.add_argument("--scale-down-delay", type=float, default=30.0, metavar="S")
    parser.add_argument("--num-gpus-per-replica", type=float, default=0.0)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return {"gateway": _run_gateway, "replica": _run_replica, "local": _run_local, "ray": _run_ray}[args.serve_command](args)


def _check_base_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ConfigError(f"--base-dir {str(path)!r} is not a checkpoint directory (no config.json)", flags=("--base-dir",))


def _run_gateway(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.router.app import RouterConfig
    from miles_disagg.service.gateway import GatewayConfig, create_gateway_app
    from miles_disagg.service.replica import listen_socket

    try:
        config = GatewayConfig(
            router=RouterConfig(health_check_interval_s=args.health_check_interval,
                                health_check_timeout_s=args.health_check_timeout, retry_after_s=args.retry_after_s,
                                request_timeout_s=args.request_timeout),
            heartbeat_timeout_s=args.heartbeat_timeout, forget_after_s=args.forget_after)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    sock = listen_socket(args.host, args.port, backlog=2048)
    server = uvicorn.Server(uvicorn.Config(create_gateway_app(config), log_level=args.log_level))
    print(f"miles-disagg serve gateway listening on http://{args.host}:{sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])
    return 0


def _replica_options_from(args: argparse.Namespace):
    from miles_disagg.service.launch import ReplicaOptions

    parse_engine(args.engine)
    return ReplicaOptions(engine=args.engine, poll_interval_s=args.poll_interval,
                          heartbeat_interval_s=args.heartbeat_interval, pause_mode=args.pause_mode,
                          max_restages=args.max_restages, pre_read_hook=args.pre_read_hook, phase_hook=args.phase_hook,
                          engine_args=tuple(args.engine_args), drain_timeout_s=args.drain_timeout)


def _run_replica(args: argparse.Namespace) -> int:
    from miles_disagg.engines.launch import EngineSpec
    from miles_disagg.service.reconciler import ReconcileConfig
    from miles_disagg.service.replica import Replica, ReplicaConfig, load_phase_hook

    _check_base_dir(args.base_dir)
    kind, attach_url = parse_engine(args.engine)
    load_phase_hook(args.phase_hook)  # fail before anything starts
    local = args.local_checkpoint_dir
    try:
        engine = EngineSpec(backend="builtin" if kind == "url" else kind, model_path=args.base_dir.resolve(),
                            local_checkpoint_dir=local, log_dir=args.log_dir or local.parent / f"{local.name}.logs",
                            host=args.host, pre_read_hook=args.pre_read_hook, extra_args=tuple(args.engine_args),
                            tp_size=args.tp_size, base_gpu_id=args.base_gpu_id, dtype=args.dtype)
        config = ReplicaConfig(
            replica_id=args.replica_id, store_dir=args.store, gateway_url=args.gateway, engine=engine,
            attach_url=attach_url,
            host=args.host, port=args.port, poll_interval_s=args.poll_interval,
            heartbeat_interval_s=args.heartbeat_interval, drain_timeout_s=args.drain_timeout,
            reconcile=ReconcileConfig(pause_mode=args.pause_mode, max_restages=args.max_restages),
            phase_hook=args.phase_hook)
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


def _work_dir(args: argparse.Namespace) -> Path:
    return args.work_dir or Path(tempfile.mkdtemp(prefix="miles-disagg-service-"))


def _run_local(args: argparse.Namespace) -> int:
    from miles_disagg.service.local import launch_local_service

    _check_base_dir(args.base_dir)
    options = _replica_options_from(args)
    work_dir = _work_dir(args)
    service = launch_local_service(args.store.resolve(), args.base_dir.resolve(), work_dir=work_dir,
                                   num_replicas=args.replicas, port=args.port, host=args.host, replica=options,
                                   heartbeat_timeout_s=args.heartbeat_timeout)
    print(f"miles-disagg serve local: gateway {service.url}, {args.replicas} replicas ready (work dir {work_dir})",
          flush=True)
    _wait_for_signal()
    service.stop()
    return 0


def _run_ray(args: argparse.Namespace) -> int:
    from miles_disagg.service.ray_pool import RayServiceConfig, run_ray_service
    from miles_disagg.service.scaling import ScalingConfig

    _check_base_dir(args.base_dir)
    try:
        scaling = ScalingConfig(min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                                target_in_flight_per_replica=args.target_in_flight,
                                scale_down_delay_s=args.scale_down_delay)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    config = RayServiceConfig(store_dir=args.store.resolve(), base_dir=args.base_dir.resolve(),
                              work_dir=_work_dir(args), host=args.host, port=args.port, scaling=scaling,
                              replica=_replica_options_from(args), num_gpus_per_replica=args.num_gpus_per_replica,
                              scale_interval_s=args.scale_interval, heartbeat_timeout_s=args.heartbeat_timeout)
    run_ray_service(config, address=args.address, stop=threading.Event(),
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
