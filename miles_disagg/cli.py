"""``miles-disagg`` command line: one subcommand per component.

Each subcommand lives in its component's own module, which exposes
``add_arguments(parser)`` and ``run(args) -> int`` (the parsed namespace carries it as
``run_command``). Modules are imported only when their subcommand runs, so
``miles-disagg --help`` stays fast (no torch/ray import).

Each subcommand's flags are fields of its config dataclass (``config/commands.py``).
Exit codes: 0 success, 2 bad input or a refused operation (one line on stderr, no
traceback; a malformed command line too), 1 an unexpected internal fault.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from miles_disagg.config.fields import ConfigArgumentParser
from miles_disagg.types import ConfigError, MilesDisaggError

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "weights": ("miles_disagg.weights.cli", "publish, apply, verify and inspect versioned weight deltas"),
    "engine": ("miles_disagg.engines.builtin.cli", "run the built-in rollout engine (SGLang HTTP API)"),
    "router": ("miles_disagg.router.cli", "run the version-aware router (worker registry, health, routing)"),
    "agent": ("miles_disagg.engines.agent.cli", "front a stock SGLang engine with /pull_weights (no fork needed)"),
    "relay": ("miles_disagg.engines.relay.cli", "serve one region's engines a store's objects, each pulled across the WAN once"),
    "serve": ("miles_disagg.service.cli", "the external rollout service: gateway, self-converging replicas, pools"),
    "make-tiny-checkpoint": ("miles_disagg.models.cli", "write a random tiny Qwen3 HF checkpoint (no download)"),
    "convert-fp8": ("miles_disagg.weights.fp8_convert", "convert an HF checkpoint to blockwise FP8 (what SGLang serves)"),
    "bench": ("miles_disagg.bench.cli", "benchmarks that print one JSON object"),
    "report": ("miles_disagg.loop.report_cli", "rebuild summary.json and report.png of a run directory from its records"),
    "engines": ("miles_disagg.fleet.members_cli", "engines join and leave a running job: add, remove, list"),
    "sim-engines": ("miles_disagg.bench.sim.cli", "simulated engines for scale benchmarks (no model)"),
}


class _CommandLineParser(ConfigArgumentParser):
    """Its errors (and those of every subcommand parser) name the (sub)command: one line, exit 2."""

    def error(self, message: str):  # type: ignore[override]
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            message += _did_you_mean(message[len(prefix):].split(), _option_strings(self))
        raise ConfigError(f"{self.prog}: error: {message} (see --help)")


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--option`` of ``parser`` and of the subcommand parsers built under it."""
    options = []
    for action in parser._actions:
        options += [o for o in action.option_strings if o.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                options += _option_strings(sub)
    return options


def _did_you_mean(tokens: list[str], options: list[str]) -> str:
    from miles_disagg.config.loader import closest

    hints = [f"{token}: did you mean {hint}?" for token in tokens if token.startswith("--")
             for hint in [closest(token.split("=", 1)[0], sorted(set(options)))] if hint]
    return f" ({'; '.join(hints)})" if hints else ""


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _CommandLineParser(prog="miles-disagg", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        if name == wanted:  # import only the module that will run
            module = importlib.import_module(module_name)
            module.add_arguments(sub)
            sub.set_defaults(run_command=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser(argv).parse_args(argv)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        return int(args.run_command(args) or 0)
    except MilesDisaggError as exc:
        print(f"miles-disagg {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
