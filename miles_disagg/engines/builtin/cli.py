"""Run the built-in rollout engine: an HF causal LM behind SGLang's HTTP API.

``miles-disagg engine --model-path DIR --port P`` (or ``python -m miles_disagg.engines.builtin``).
Binds 127.0.0.1 unless ``--host`` says otherwise. Logs go to stderr.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model-path", required=True, type=Path, help="HF causal LM checkpoint directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=30000, help="HTTP port (default: 30000)")
    parser.add_argument(
        "--weight-version", default="0",
        help="version reported before any update (string, as in SGLang; this project uses ints; default: 0)",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto")
    parser.add_argument("--max-running-requests", type=int, default=64, help="most requests batched together")
    parser.add_argument("--random-seed", type=int, default=0, help="seeds requests without sampling_seed")
    parser.add_argument(
        "--custom-pull-weights-pre-read-hook", default=None, metavar="MODULE:FUNCTION",
        help="run hook(source_dir, target_version) before /pull_weights reads a version "
             "(miles passes --sglang-custom-pull-weights-pre-read-hook here)",
    )
    parser.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from miles_disagg.engines.builtin.runtime import Engine, EngineConfig
    from miles_disagg.engines.builtin.server import create_app
    from miles_disagg.types import ConfigError
    from miles_disagg.weights.hooks import PRE_READ_FLAG, load_hook

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not (args.model_path / "config.json").is_file():
        raise ConfigError(f"--model-path {str(args.model_path)!r} is not a checkpoint directory (no config.json)",
                          flags=("--model-path",))
    try:
        config = EngineConfig(
            model_path=args.model_path, host=args.host, port=args.port, weight_version=str(args.weight_version),
            device=args.device, dtype=args.dtype, max_running_requests=args.max_running_requests,
            random_seed=args.random_seed, pull_weights_pre_read_hook=args.custom_pull_weights_pre_read_hook,
        )
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    load_hook(config.pull_weights_pre_read_hook, PRE_READ_FLAG)  # fail before the model loads
    engine = Engine(config)
    engine.start()
    try:
        uvicorn.run(create_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.stop()
    return 0
