"""Run the version-aware router: ``miles-disagg router --port P --worker URL ...``.

Binds 127.0.0.1 unless ``--host`` says otherwise. Prints one line once the socket is
listening (``miles-disagg router listening on http://HOST:PORT``); logs go to stderr.
A port already in use or an invalid setting exits 2 before anything is served.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

DEFAULT_PORT = 30080


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"HTTP port (default: {DEFAULT_PORT})")
    parser.add_argument("--worker", dest="workers", action="extend", nargs="+", default=[], metavar="URL",
                        help="engine URL(s) registered at start (repeatable); more via POST /add_worker")
    parser.add_argument("--health-check-interval", type=float, default=1.0, metavar="S",
                        help="seconds between health checks of every worker (default: 1.0)")
    parser.add_argument("--health-check-timeout", type=float, default=2.0, metavar="S",
                        help="timeout of one health probe (default: 2.0)")
    parser.add_argument("--health-failure-threshold", type=int, default=2, metavar="N",
                        help="probe timeouts in a row that take a worker out; a refused connection "
                             "or an error status takes it out at once (default: 2)")
    parser.add_argument("--retry-after-s", type=float, default=1.0, metavar="S",
                        help="wait advised to clients with 409/503 answers (default: 1.0)")
    parser.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                        help="read timeout of a proxied generation request (default: 600)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.router.app import RouterConfig, create_app
    from miles_disagg.router.registry import normalize_url
    from miles_disagg.types import ConfigError, InvalidInput

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        workers = tuple(normalize_url(url) for url in args.workers)
        config = RouterConfig(
            workers=workers, health_check_interval_s=args.health_check_interval,
            health_check_timeout_s=args.health_check_timeout, health_failure_threshold=args.health_failure_threshold,
            retry_after_s=args.retry_after_s, request_timeout_s=args.request_timeout,
        )
    except (ValueError, InvalidInput) as exc:
        raise ConfigError(str(exc)) from exc
    sock = _listen(args.host, args.port)
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level=args.log_level))
    port = sock.getsockname()[1]  # the real one when --port 0
    print(f"miles-disagg router listening on http://{args.host}:{port} ({len(workers)} workers)", flush=True)
    server.run(sockets=[sock])
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """Bind and listen now, so a taken port fails fast with a clear message."""
    from miles_disagg.process import listen_socket

    return listen_socket(host, port)
