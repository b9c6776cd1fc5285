"""Run the version-aware router: ``miles-disagg router --port P --worker URL ...``.

Binds 127.0.0.1 unless ``--host`` says otherwise. Prints one line once the socket is
listening (``miles-disagg router listening on http://HOST:PORT``); logs go to stderr.
A port already in use or an invalid setting exits 2 before anything is served.

``--router-workers N`` (N > 1): N processes serve the port (``SO_REUSEPORT``), so routing throughput grows
with cores: this one probes the workers and takes the registry calls, the others route from the view it
publishes (:mod:`miles_disagg.router.group`, :mod:`miles_disagg.router.peers`).
"""

from __future__ import annotations

import argparse
import socket
from dataclasses import dataclass

from miles_disagg.config.commands import ServerFlags, add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

DEFAULT_PORT = 30080


@dataclass(kw_only=True)
class RouterCommand(ServerFlags):
    """Run the version-aware router (worker registry, health, routing)."""

    port: int = flag(DEFAULT_PORT, "HTTP port (0: any free port).")
    workers: list[str] = flag([], "Engine URL(s) registered at start (repeatable); more via POST /add_worker.",
                              name="--worker", metavar="URL", repeat="extend")
    health_check_interval: float = flag(1.0, "Seconds between health checks of every worker.", metavar="S")
    health_check_timeout: float = flag(2.0, "Timeout of one health probe.", metavar="S")
    health_failure_threshold: int = flag(2, "Probe timeouts in a row that take a worker out; a refused connection "
                                            "or an error status takes it out at once.", metavar="N")
    retry_after_s: float = flag(1.0, "Wait advised to clients with 409/503 answers.", metavar="S")
    request_timeout: float = flag(600.0, "Read timeout of a proxied generation request.", metavar="S")
    router_workers: int = flag(1, "Processes serving the port (one probes and takes the registry calls, all route); "
                                  "more than 1 when one process's core is the limit.", metavar="N")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.router_workers < 1:
            raise ValueError(f"--router-workers must be >= 1, got {self.router_workers}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, RouterCommand)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.router.app import create_app
    from miles_disagg.router.config import RouterConfig
    from miles_disagg.router.registry import normalize_url
    from miles_disagg.types import ConfigError, InvalidInput

    command = config_from_args(RouterCommand, args)
    command.configure_logging()
    try:
        workers = tuple(normalize_url(url) for url in command.workers)
        config = RouterConfig(
            workers=workers, health_check_interval_s=command.health_check_interval,
            health_check_timeout_s=command.health_check_timeout,
            health_failure_threshold=command.health_failure_threshold,
            retry_after_s=command.retry_after_s, request_timeout_s=command.request_timeout,
        )
    except (ValueError, InvalidInput) as exc:
        raise ConfigError(str(exc)) from exc
    if command.router_workers > 1:
        return _run_group(command, config)
    sock = _listen(command.host, command.port)
    server = uvicorn.Server(uvicorn.Config(create_app(config, guard=command.guard()), log_level=command.log_level,
                                           proxy_headers=False))
    port = sock.getsockname()[1]  # the real one when --port 0
    print(f"miles-disagg router listening on http://{command.host}:{port} ({len(workers)} workers)", flush=True)
    server.run(sockets=[sock])
    return 0


def _run_group(command: RouterCommand, config) -> int:
    """``--router-workers N``: this process is the leader of N (see the module docstring)."""
    import secrets

    import uvicorn

    from miles_disagg.net.process import listen_socket
    from miles_disagg.router.app import create_app
    from miles_disagg.router.group import RouterGroup
    from miles_disagg.router.peers import LeaderPeers
    from miles_disagg.router.registry import WorkerRegistry

    # a plain bind first: a port another server holds is refused, even one that set SO_REUSEPORT too
    probe = listen_socket(command.host, command.port)
    port = probe.getsockname()[1]
    probe.close()
    sock = listen_socket(command.host, port, reuse_port=True)
    guard, server_id = command.guard(), secrets.token_hex(8)
    group = RouterGroup(processes=command.router_workers, host=command.host, port=port, config=config,
                        server_id=server_id, keys=guard.keys, max_request_bytes=guard.max_request_bytes,
                        log_level=command.log_level)
    try:
        registry = WorkerRegistry(failure_threshold=config.health_failure_threshold)
        app = create_app(config, registry, guard, peers=LeaderPeers(registry, group.table), group=group,
                         server_id=server_id)
        server = uvicorn.Server(uvicorn.Config(app, log_level=command.log_level, proxy_headers=False))
        print(f"miles-disagg router listening on http://{command.host}:{port} ({len(config.workers)} workers, "
              f"{command.router_workers} processes)", flush=True)
        server.run(sockets=[sock, group.leader_socket])
    finally:
        group.close()
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen now, so a taken port fails fast with a clear message."""
    from miles_disagg.net.process import listen_socket

    return listen_socket(host, port)
