"""``miles-disagg agent``: run the agent in front of one engine on this host.

``miles-disagg agent --engine-url http://127.0.0.1:30000 --local-checkpoint-dir /nvme/ckpt --port 30010``
(or ``python -m miles_disagg.engines.agent ...``). Binds 127.0.0.1 unless ``--host`` says otherwise.
Bad input (a malformed ``--engine-url``, an unusable local checkpoint dir or base dir, a
pre-read hook that does not load, an engine that is not up within ``--wait-for-engine-s``)
exits 2 with a message before anything is served.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from miles_disagg.types import ConfigError

ENGINE_URL_FLAG = "--engine-url"
LOCAL_DIR_FLAG = "--local-checkpoint-dir"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(ENGINE_URL_FLAG, required=True, help="base URL of the engine to front, e.g. http://127.0.0.1:30000")
    parser.add_argument(LOCAL_DIR_FLAG, required=True, type=Path,
                        help="host-local checkpoint the agent materializes versions into (it owns this path)")
    parser.add_argument("--port", required=True, type=int, help="HTTP port of the agent")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--base-dir", type=Path, default=None,
                        help="base checkpoint (version 0); default: the engine's model_path, read at the first pull")
    parser.add_argument(
        "--custom-pull-weights-pre-read-hook", default=None, metavar="MODULE:FUNCTION",
        help="run hook(source_dir, target_version) before a pull reads a version "
             "(miles passes --sglang-custom-pull-weights-pre-read-hook here)",
    )
    parser.add_argument("--wait-for-engine-s", type=float, default=0.0,
                        help="wait up to this long for the engine's /health before serving (default 0: do not wait)")
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.engines.agent.app import Agent, AgentConfig, create_app

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_url = check_engine_url(args.engine_url)
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {args.port}", flags=("--port",))
    check_local_dir(args.local_checkpoint_dir)
    if args.base_dir is not None and not (args.base_dir / "config.json").is_file():
        raise ConfigError(f"--base-dir {str(args.base_dir)!r} is not a checkpoint directory (no config.json)",
                          flags=("--base-dir",))
    agent = Agent(AgentConfig(engine_url=engine_url, local_checkpoint_dir=args.local_checkpoint_dir,
                              base_dir=args.base_dir, pre_read_hook=args.custom_pull_weights_pre_read_hook))
    if args.wait_for_engine_s > 0:
        wait_for_engine(engine_url, args.wait_for_engine_s)
    uvicorn.run(create_app(agent), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def check_engine_url(url: str) -> str:
    """``http(s)://host:port`` (no path, query or credentials), without a trailing slash; else ``ConfigError``."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"{ENGINE_URL_FLAG} {url!r} is not a URL ({exc})", flags=(ENGINE_URL_FLAG,)) from None
    problem = None
    if parts.scheme not in ("http", "https"):
        problem = "it must start with http:// or https://"
    elif not parts.hostname:
        problem = "it names no host"
    elif parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        problem = "it must be only scheme://host:port (no path, query or credentials)"
    elif port is None:
        problem = "it names no port"
    if problem:
        raise ConfigError(f"{ENGINE_URL_FLAG} {url!r} is not an engine base URL: {problem}", flags=(ENGINE_URL_FLAG,))
    return url.rstrip("/")


def check_local_dir(path: Path) -> None:
    """The local checkpoint must be absent, an empty directory, or a symlink the agent made earlier."""
    parent = Path(os.path.abspath(path)).parent
    if not parent.is_dir():
        raise ConfigError(f"{LOCAL_DIR_FLAG}: the parent directory {str(parent)!r} does not exist", flags=(LOCAL_DIR_FLAG,))
    if path.is_symlink() or not path.exists():
        return  # a foreign symlink is refused by the materializer with its own message
    if not path.is_dir() or any(path.iterdir()):
        raise ConfigError(f"{LOCAL_DIR_FLAG} {str(path)!r} already holds files not managed by miles-disagg; "
                          "remove it or pick another path", flags=(LOCAL_DIR_FLAG,))


def wait_for_engine(engine_url: str, timeout_s: float) -> None:
    from miles_disagg.process import NotHealthy, wait_healthy

    try:
        wait_healthy(engine_url, timeout_s=timeout_s, poll_s=0.5)
    except NotHealthy as exc:
        raise ConfigError(f"the engine at {engine_url} is {exc.reason}",
                          flags=(ENGINE_URL_FLAG, "--wait-for-engine-s")) from None
