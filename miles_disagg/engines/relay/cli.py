"""``miles-disagg relay``: serve one region's engines the objects of a store, each pulled once.

``miles-disagg relay --store s3://bucket/run1 --cache-dir /nvme/relay --region eu --port 9400``
(binds 127.0.0.1 unless ``--host`` says otherwise). Engines of the region name it in their store:
``--weight-store-dir 's3://bucket/run1?relay=http://relay-host:9400'`` (managed engines:
``--update-weight-relay eu=http://relay-host:9400``). Keys: ``--api-key`` or the environment's,
as every server of this project.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.config.commands import ServerFlags, add_config_arguments, config_from_args
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.engines.relay.cache import DEFAULT_MAX_VERSIONS
from miles_disagg.types import ConfigError


@dataclass(kw_only=True)
class RelayCommand(ServerFlags):
    """Serve a region's engines a store's objects, each pulled across the WAN once."""

    store: str = flag(REQUIRED, "The object store (s3://bucket/prefix) whose versions this relay serves.")
    cache_dir: Path = flag(REQUIRED, "Where the relay keeps the objects it pulled (its own directory).")
    region: str = flag("", "The region this relay serves (reported in /relay_info).", metavar="NAME")
    max_versions: int = flag(DEFAULT_MAX_VERSIONS, "Versions whose objects the cache keeps (older ones are deleted).")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, RelayCommand)


def run(args: argparse.Namespace) -> int:
    import socket

    import uvicorn

    from miles_disagg.engines.relay.app import create_app
    from miles_disagg.engines.relay.cache import RelayCache
    from miles_disagg.weights.location import is_object_store, parse_object_url

    command = config_from_args(RelayCommand, args)
    command.configure_logging()
    if not is_object_store(command.store):
        raise ConfigError(f"--store {command.store[:200]!r}: a relay serves an object store (s3://bucket/prefix); "
                          "engines read a directory store directly", flags=("--store",))
    location = parse_object_url(command.store, "--store")
    command.cache_dir.mkdir(parents=True, exist_ok=True)
    app = create_app(RelayCache(location, command.cache_dir, max_versions=command.max_versions), command.region,
                     command.guard())
    sock = socket.socket(socket.AF_INET6 if ":" in command.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((command.host, command.port))
    sock.listen(2048)  # before the line is printed: whoever reads it may connect at once
    print(f"miles-disagg relay listening on http://{command.host}:{sock.getsockname()[1]}", flush=True)
    server = uvicorn.Server(uvicorn.Config(app, log_level=command.log_level))
    server.run(sockets=[sock])
    return 0
