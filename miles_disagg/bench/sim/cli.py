"""``miles-disagg sim-engines --num-engines N``: many simulated engines in one process, one port each.

For scale benchmarks and tests (see :mod:`miles_disagg.bench.sim.engines`). Prints one line once every
engine listens: ``{"urls": [...]}`` (JSON), then serves until interrupted. Binds 127.0.0.1 unless
``--host`` says otherwise; keys and the request limit as every server (``--api-key`` ...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import dataclass

from miles_disagg.net.pooled_http import run_loop
from miles_disagg.config.commands import ServerFlags, add_config_arguments, config_from_args
from miles_disagg.config.fields import flag


@dataclass(kw_only=True)
class SimEnginesCommand(ServerFlags):
    """Run simulated engines (the engine HTTP surface with a latency model, no model)."""

    num_engines: int = flag(8, "How many engines; engine i binds --port + i (--port 0: a free port each).",
                            metavar="N")
    per_request_ms: float = flag(20.0, "Fixed time of one /generate.", metavar="MS")
    per_token_ms: float = flag(0.0, "Time per new token of one /generate.", metavar="MS")
    pull_ms: float = flag(100.0, "Time of /pull_weights.", metavar="MS")
    pause_ms: float = flag(0.0, "Time of /pause_generation.", metavar="MS")
    load_ms: float = flag(50.0, "Time of /update_weights_from_disk.", metavar="MS")
    stock_activation: bool = flag(False, "Answer as stock SGLang attached directly: no /activate_weights, none "
                                  "announced (updaters take the per-step activation).")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("per_request_ms", "per_token_ms", "pull_ms", "pause_ms", "load_ms"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if self.num_engines < 1:
            raise ValueError(f"--num-engines must be >= 1, got {self.num_engines}")

    def latency(self):
        from miles_disagg.bench.sim.engines import LatencyModel

        return LatencyModel(per_request_s=self.per_request_ms / 1e3, per_token_s=self.per_token_ms / 1e3,
                            pull_s=self.pull_ms / 1e3, pause_s=self.pause_ms / 1e3, load_s=self.load_ms / 1e3)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, SimEnginesCommand)


def run(args: argparse.Namespace) -> int:
    command = config_from_args(SimEnginesCommand, args)
    command.configure_logging()
    try:
        run_loop(_serve(command))
    except KeyboardInterrupt:
        pass
    return 0


async def _serve(command: SimEnginesCommand) -> None:
    from miles_disagg.bench.sim.engines import SimulatedFleet

    fleet = SimulatedFleet(command.num_engines, command.latency(), host=command.host, guard=command.guard(),
                           one_call=not command.stock_activation)
    urls = await fleet.start(command.port)
    print(json.dumps({"urls": urls}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await fleet.stop()
