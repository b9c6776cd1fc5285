"""``miles-disagg agent``: run the agent in front of one engine on this host.

``miles-disagg agent --engine-url http://127.0.0.1:30000 --local-checkpoint-dir /nvme/ckpt --port 30010``
(or ``python -m miles_disagg.engines.agent ...``). Binds 127.0.0.1 unless ``--host`` says otherwise.
Bad input (a malformed ``--engine-url``, an unusable local checkpoint dir or base dir, a
pre-read hook that does not load, an engine that is not up within ``--wait-for-engine-s``)
exits 2 with a message before anything is served.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from miles_disagg.config.commands import ServerFlags, add_config_arguments, config_from_args
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.engines.builtin.config import REGION_HELP
from miles_disagg.engines.roots import lora_base_from_store_dir
from miles_disagg.types import ConfigError

ENGINE_URL_FLAG = "--engine-url"
LOCAL_DIR_FLAG = "--local-checkpoint-dir"


@dataclass(kw_only=True)
class AgentCommand(ServerFlags):
    """Front a stock SGLang engine with /pull_weights (no fork needed)."""

    port: int = flag(REQUIRED, "HTTP port of the agent.")
    engine_url: str = flag(REQUIRED, "Base URL of the engine to front, e.g. http://127.0.0.1:30000.")
    local_checkpoint_dir: Path = flag(REQUIRED, "Host-local checkpoint the agent materializes versions into "
                                                "(it owns this path).")
    base_dir: Path | None = flag(None, "Base checkpoint (version 0); default: the engine's model_path, read at "
                                       "the first pull.")
    custom_pull_weights_pre_read_hook: str | None = flag(
        None, "Run hook(source_dir, target_version) before a pull reads a version "
              "(miles passes --sglang-custom-pull-weights-pre-read-hook here).", metavar="MODULE:FUNCTION")
    weight_store_dirs: list[str] = flag([], "A version store /pull_weights may read (repeatable); any other "
                                             "source_dir is refused with 403.",
                                         name="--weight-store-dir", metavar="DIR", repeat="append")
    region: str = flag("", REGION_HELP, metavar="NAME")
    lora_roots: list[str] = flag([], "A directory /load_lora_adapter may name a LoRA adapter under (repeatable); "
                                     "any other lora_path is refused with 403 before it reaches the engine.",
                                 name="--lora-root", metavar="DIR", repeat="append")
    lora_base_dir: Path | None = flag(None, "A run's LoRA adapter chain (its version 0): /pull_weights materializes "
                                            "the store's adapter versions and /activate_weights loads each into the "
                                            "engine beside the base without a pause; every /generate then runs on an "
                                            "adapter (the engine needs SGLang's --enable-lora).", metavar="DIR")
    lora_base_from_store: bool = flag(False, "The adapter chain's version 0 comes from the object store "
                                             "(--weight-store-dir s3://...): the first /pull_weights fetches it "
                                             "onto this node, into --lora-base-dir (default: "
                                             "<--local-checkpoint-dir>.lora-v0).")
    lora_resident_versions: int = flag(2, "With --lora-base-dir: the newest adapter versions kept loaded.", metavar="K")
    wait_for_engine_s: float = flag(0.0, "Wait up to this long for the engine's /health before serving "
                                         "(0: do not wait).")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        if self.lora_resident_versions < 1:
            raise ValueError(f"--lora-resident-versions must be >= 1, got {self.lora_resident_versions}")
        if self.lora_base_from_store:
            object.__setattr__(self, "lora_base_dir",  # a frozen config: its default fixed here once
                               lora_base_from_store_dir(self.lora_base_dir, self.local_checkpoint_dir,
                                                        self.weight_store_dirs))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, AgentCommand)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.engines.agent.app import create_app
    from miles_disagg.engines.agent.state import Agent, AgentConfig

    command = config_from_args(AgentCommand, args)
    command.configure_logging()
    engine_url = check_engine_url(command.engine_url)
    check_local_dir(command.local_checkpoint_dir)
    if command.base_dir is not None and not (command.base_dir / "config.json").is_file():
        raise ConfigError(f"--base-dir {str(command.base_dir)!r} is not a checkpoint directory (no config.json)",
                          flags=("--base-dir",))
    agent = Agent(AgentConfig(engine_url=engine_url, local_checkpoint_dir=command.local_checkpoint_dir,
                              base_dir=command.base_dir, pre_read_hook=command.custom_pull_weights_pre_read_hook,
                              store_dirs=tuple(command.weight_store_dirs), guard=command.guard(),
                              region=command.region, lora_roots=tuple(command.lora_roots),
                              lora_base_dir=command.lora_base_dir, lora_base_from_store=command.lora_base_from_store,
                              lora_resident_versions=command.lora_resident_versions))
    if command.wait_for_engine_s > 0:
        wait_for_engine(engine_url, command.wait_for_engine_s)
    uvicorn.run(create_app(agent), host=command.host, port=command.port, log_level=command.log_level)
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
    from miles_disagg.net.process import NotHealthy, wait_healthy

    try:
        wait_healthy(engine_url, timeout_s=timeout_s, poll_s=0.5)
    except NotHealthy as exc:
        raise ConfigError(f"the engine at {engine_url} is {exc.reason}",
                          flags=(ENGINE_URL_FLAG, "--wait-for-engine-s")) from None
