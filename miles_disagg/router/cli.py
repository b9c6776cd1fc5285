"""Run the version-aware router: ``miles-disagg router --port P --worker URL ...``.

Binds 127.0.0.1 unless ``--host`` says otherwise. Prints one line once the socket is
listening (``miles-disagg router listening on http://HOST:PORT``); logs go to stderr.
A port already in use or an invalid setting exits 2 before anything is served.
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
    sock = _listen(command.host, command.port)
    server = uvicorn.Server(uvicorn.Config(create_app(config, guard=command.guard()), log_level=command.log_level))
    port = sock.getsockname()[1]  # the real one when --port 0
    print(f"miles-disagg router listening on http://{command.host}:{port} ({len(workers)} workers)", flush=True)
    server.run(sockets=[sock])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen now, so a taken port fails fast with a clear message."""
    from miles_disagg.net.process import listen_socket

    return listen_socket(host, port)
