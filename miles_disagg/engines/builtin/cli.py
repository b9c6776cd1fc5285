"""Run the built-in rollout engine: an HF causal LM behind SGLang's HTTP API.

``miles-disagg engine --model-path DIR --port P`` (or ``python -m miles_disagg.engines.builtin``).
Binds 127.0.0.1 unless ``--host`` says otherwise. Logs go to stderr. The flags are the
fields of :class:`~miles_disagg.engines.builtin.config.EngineConfig` plus ``--log-level``.
"""

from __future__ import annotations

import argparse

from miles_disagg.config.commands import LogFlags, add_config_arguments, config_from_args
from miles_disagg.engines.builtin.config import EngineConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineConfig, LogFlags)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.engines.builtin.runtime import Engine
    from miles_disagg.engines.builtin.server import create_app
    from miles_disagg.types import ConfigError
    from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook

    config, logs = config_from_args(EngineConfig, args), config_from_args(LogFlags, args)
    logs.configure_logging()
    if not (config.model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {str(config.model_path)!r} is not a checkpoint directory (no config.json)",
                          flags=("--model-path",))
    load_hook(config.pull_weights_pre_read_hook, PRE_READ_FLAG)  # fail before the model loads
    engine = Engine(config)
    engine.start()
    try:
        uvicorn.run(create_app(engine, config.guard()), host=config.host, port=config.port, log_level=logs.log_level)
    finally:
        engine.stop()
    return 0
