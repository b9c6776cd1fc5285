"""``miles-disagg bench {delta,engine,async,service,hostile,colocate,http,scale,publish,store,lora,agentic}``: dispatch to the benchmark modules.

Each benchmark module exposes ``add_arguments(parser)`` and ``run(args) -> int`` (the parsed
namespace carries it as ``run_benchmark``) and prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "delta": ("miles_disagg.bench.delta", "disk-delta codec: ours vs the reference codec"),
    "engine": ("miles_disagg.bench.engine", "built-in engine throughput and activation pause"),
    "async": ("miles_disagg.bench.async_train", "train.py vs train_async.py throughput and engine busy fraction"),
    "service": ("miles_disagg.bench.service", "rollout service: convergence, pauses, gateway overhead under load"),
    "hostile": ("miles_disagg.bench.hostile", "oversized and hostile bodies: time to refusal, engine RSS, /health"),
    "colocate": ("miles_disagg.bench.colocate", "--colocate memory handoff: engine and trainer RSS released/offloaded"),
    "http": ("miles_disagg.bench.http_client", "the generation hot path's HTTP client: httpx vs pooled_http"),
    "scale": ("miles_disagg.bench.scale", "control plane at scale with simulated engines: fan-out, router, memory"),
    "publish": ("miles_disagg.bench.publish", "sharded publication: per-rank snapshot and payload bytes, wall, wire by rank count"),
    "lora": ("miles_disagg.bench.lora", "LoRA adapter versions vs full weights: bytes, activation stall, mixing, throughput"),
    "agentic": ("miles_disagg.bench.agentic", "agent sessions over N engines: prefix-cache hits and sessions/s with and without affinity"),
    "store": ("miles_disagg.bench.store", "object store vs shared directory, one WAN copy per region with a relay, pull memory"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    subparsers = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    subparsers.required = True
    for name, (module_name, help_text) in BENCHMARKS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(sub)
        sub.set_defaults(run_benchmark=module.run)


def run(args: argparse.Namespace) -> int:
    return int(args.run_benchmark(args) or 0)
