"""``miles-disagg bench lora``: LoRA adapter versions against full-weight versions, on the built-in engine.

One run, every ratio measured side by side on a random Qwen3 (`--hidden-size`, `--num-layers`):

* ``adapter_bytes_vs_full``: wire bytes of an adapter version (rank `--rank`, all-linear) against
  a full-weight version of the same model after the same optimizer steps (both published by
  :class:`~miles_disagg.weights.publisher.DeltaPublisher` as xor deltas, the plain format);
* ``trainer_step_time_lora_vs_full``: the fsdp backend's step time with the adapter against full
  fine-tuning, on the same samples;
* ``activation_stall_vs_median_gap``: requests decode on adapter version 1 while version 2 is
  pulled from the store, verified, loaded beside it and version 1 unloaded (the LoRA activation:
  no pause); the longest gap between an in-flight request's tokens during the activation against
  the median gap of the whole run. ``full_activation_stall_vs_median_gap``: the same for today's
  full-weight activation (pull, then pause, load, flush, continue in one call) of a version;
* ``samples_mixing_versions``: requests in flight across the activation whose logprobs are not
  all those of the adapter they started on (each checked against a forward pass with it; the
  check can see mixing: ``mixing_detectable``, version 2's logprobs differ);
* ``throughput_two_adapters_vs_one`` / ``throughput_one_adapter_vs_base``: samples per second of
  one batch of `--requests` requests on one adapter, on two (alternating), and on the base
  (interleaved rounds, the best of each).

The engine is driven in this process through its own request path (``make_sequences``, the
scheduler, its LoRA bank). Prints one JSON object; progress on stderr.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.common import print_result, progress, qwen3_shape, work_dir
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag

_say = progress("lora")
ROUNDS = 2


@dataclass(kw_only=True)
class LoraBench:
    """LoRA adapter versions vs full-weight versions: bytes, activation stall, mixing, throughput, step time"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    hidden_size: int = flag(1024, "Hidden size of the random Qwen3 (a multiple of 64).")
    num_layers: int = flag(2, "Layers of the random Qwen3.")
    rank: int = flag(8, "LoRA rank (alpha = 2 x rank, all-linear).")
    steps: int = flag(3, "Optimizer steps, each published as a version (adapter and full weights).")
    requests: int = flag(16, "Requests per throughput batch, and in flight across an activation (a quarter).")
    max_new_tokens: int = flag(48, "Tokens per throughput request (in-flight requests across an activation: 4x).")
    work_dir: Path | None = flag(None, "Keep the model and stores here (default: a temp dir).")

    def __post_init__(self) -> None:
        qwen3_shape(self.hidden_size, self.num_layers)  # ValueError naming the flag
        for name in ("rank", "steps", "requests", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, LoraBench)


def run(args: argparse.Namespace) -> int:
    command = config_from_args(LoraBench, args)
    with work_dir("lora", command.work_dir) as root:
        result = _bench(root, command)
    return print_result(result)


def _bench(root: Path, command: LoraBench) -> dict:
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    model_dir = make_tiny_qwen3(root / "model", **qwen3_shape(command.hidden_size, command.num_layers))
    published = _publish_both(root, model_dir, command)
    _say(f"adapter version {published['adapter_bytes']:.0f} B, full version {published['full_bytes']:.0f} B")
    engine = _engine(root, model_dir)
    try:
        served = _serve(engine, root, published, command)
    finally:
        engine.stop()
    return {"adapter_bytes_vs_full": published["adapter_bytes"] / published["full_bytes"],
            "adapter_version_bytes": published["adapter_bytes"], "full_version_bytes": published["full_bytes"],
            "trainer_step_time_lora_vs_full": published["lora_step_s"] / published["full_step_s"],
            **served, "config": {"hidden_size": command.hidden_size, "num_layers": command.num_layers,
                                 "rank": command.rank, "steps": command.steps, "requests": command.requests,
                                 "max_new_tokens": command.max_new_tokens}}


# ------------------------------------------------------------------ trainer side


def _samples(step: int, vocab: int):
    from miles_disagg.samples import Sample

    return [Sample(prompt_ids=[3, 4, 5, 6], response_ids=[(7 + i + step) % vocab, 8, (9 + i) % vocab],
                   response_logprobs=[-3.0] * 3, advantage=float(i % 2) - 0.5) for i in range(8)]


def _publish_both(root: Path, model_dir: Path, command: LoraBench) -> dict:
    """The same steps trained twice (adapter, full weights), every step published into its own store."""
    from miles_disagg.config.components import TrainConfig
    from miles_disagg.trainer.fsdp import FSDPBackend
    from miles_disagg.trainer.lora import adapter_config
    from miles_disagg.weights.adapters import write_adapter_dir
    from miles_disagg.weights.publisher import DeltaPublisher

    common = dict(global_batch_size=8, micro_batch_size=8, train_backend="fsdp")
    runs = {}
    for kind, config in (("adapter", TrainConfig(lr=1e-2, lora_rank=command.rank, lora_alpha=2 * command.rank,
                                                 **common)),
                         ("full", TrainConfig(lr=1e-3, **common))):
        trainer = FSDPBackend(config, str(model_dir), rank=0, world_size=1)
        base = model_dir
        if kind == "adapter":
            base = write_adapter_dir(root / "adapter-v0", adapter_config(trainer.lora), trainer.adapter_tensors())
        publisher = DeltaPublisher(root / f"{kind}-store", base_dir=base, run_id=kind, encoding="xor", filter="none")
        publisher.capture_baseline()
        wire, step_s = [], []
        for step in range(command.steps):
            started = time.perf_counter()
            trainer.train([_samples(step, trainer.module.config.vocab_size)])
            step_s.append(time.perf_counter() - started)
            tensors = trainer.adapter_tensors().items() if kind == "adapter" else trainer.named_tensors()
            wire.append(publisher.publish(tensors).wire_bytes)
        publisher.close()
        runs[kind] = (statistics.mean(wire), statistics.median(step_s))
        _say(f"{kind}: {command.steps} steps published")
    return {"adapter_bytes": runs["adapter"][0], "full_bytes": runs["full"][0], "lora_step_s": runs["adapter"][1],
            "full_step_s": runs["full"][1], "adapter_base": root / "adapter-v0", "adapter_store": root / "adapter-store",
            "full_store": root / "full-store"}


# ------------------------------------------------------------------ engine side


def _engine(root: Path, model_dir: Path):
    from miles_disagg.engines.builtin.runtime import Engine, EngineConfig

    engine = Engine(EngineConfig(model_path=model_dir, enable_lora=True, lora_roots=[str(root)],
                                 max_loaded_loras=3, weight_store_dirs=[str(root / "full-store")],
                                 local_checkpoint_dir=root / "local", prefix_cache_tokens=0, max_running_requests=64))
    engine.start()
    return engine


class _Timed:
    """A sink recording each token's arrival."""

    def __init__(self):
        self.times: list[float] = []
        self.done = threading.Event()
        self.seq = None

    def on_token(self, seq) -> None:
        self.times.append(time.perf_counter())

    def on_finish(self, seq) -> None:
        self.seq = seq
        self.done.set()


def _submit(engine, lora_paths: list[str | None], max_new_tokens: int) -> list[_Timed]:
    from miles_disagg.engines.builtin.protocol import parse_generate

    request = parse_generate({"input_ids": [[3, 4, 5, 6 + i % 5] for i in range(len(lora_paths))],
                              "lora_path": lora_paths, "return_logprob": True,
                              "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                                  "ignore_eos": True}})
    sinks = [_Timed() for _ in lora_paths]
    for seq in engine.make_sequences(request, lambda item: sinks[request.items.index(item)]):
        engine.submit(seq)
    return sinks


def _wait(sinks: list[_Timed]) -> None:
    for sink in sinks:
        if not sink.done.wait(600):
            raise TimeoutError("a benchmark request did not finish in 600 s")


def _materialize(root: Path, published: dict, version: int) -> Path:
    from miles_disagg.weights.materializer import Materializer

    host = Materializer(root / f"lora-local-v{version}", base_dir=published["adapter_base"])
    try:
        return host.prepare(published["adapter_store"], version).path
    finally:
        host.close()


def _throughput(engine, lora_paths: list[str | None], max_new_tokens: int) -> float:
    started = time.perf_counter()
    _wait(_submit(engine, lora_paths, max_new_tokens))
    return len(lora_paths) / (time.perf_counter() - started)


def _stall(sinks: list[_Timed], window: tuple[float, float]) -> float:
    """The longest gap between an in-flight request's tokens that overlaps ``window``, over the
    median gap of all of them."""
    gaps, during = [], []
    for sink in sinks:
        for before, after in zip(sink.times, sink.times[1:]):
            gaps.append(after - before)
            if after >= window[0] and before <= window[1]:
                during.append(after - before)
    return max(during or [0.0]) / statistics.median(gaps)


def _serve(engine, root: Path, published: dict, command: LoraBench) -> dict:
    bank = engine.lora
    bank.load("v1", str(_materialize(root, published, 1)))
    bank.load("v2", str(_materialize(root, published, 2)))
    n, tokens = command.requests, command.max_new_tokens
    batches = {"base": [None] * n, "one": ["v1"] * n, "two": ["v1", "v2"] * (n // 2) + ["v1"] * (n % 2)}
    _throughput(engine, batches["two"], 4)  # warm up
    rates = {name: 0.0 for name in batches}
    for _ in range(ROUNDS):  # interleaved, best of each: load on the machine hits all three alike
        for name, paths in batches.items():
            rates[name] = max(rates[name], _throughput(engine, paths, tokens))
    bank.unload("v2")
    lora_stall, mixing, detectable = _lora_activation(engine, root, published, command)
    full_stall = _full_activation(engine, published, command)
    return {"activation_stall_vs_median_gap": lora_stall, "full_activation_stall_vs_median_gap": full_stall,
            "samples_mixing_versions": mixing, "mixing_detectable": detectable,
            "throughput_two_adapters_vs_one": rates["two"] / rates["one"],
            "throughput_one_adapter_vs_base": rates["one"] / rates["base"],
            "samples_per_s": rates}


def _lora_activation(engine, root: Path, published: dict, command: LoraBench) -> tuple[float, int, bool]:
    """v1 serves in-flight requests while v2 is pulled, verified and loaded beside it, then v1 unloaded."""
    bank = engine.lora
    version = min(2, command.steps)
    in_flight = _submit(engine, ["v1"] * max(1, command.requests // 4), 4 * command.max_new_tokens)
    while min(len(s.times) for s in in_flight) < command.max_new_tokens:
        time.sleep(0.005)
    started = time.perf_counter()
    bank.load("v2-again", str(_materialize(root, published, version)))
    bank.unload("v1")  # answers at once; v1 leaves with its last request
    window = (started, time.perf_counter())
    _wait(in_flight)
    bank.load("v1-check", str(_materialize(root, published, 1)))
    mixing = sum(not _same_logprobs(engine, sink.seq, "v1-check") for sink in in_flight)
    detectable = not _same_logprobs(engine, in_flight[0].seq, "v2-again")
    for name in ("v1-check", "v2-again"):
        bank.unload(name)
    return _stall(in_flight, window), mixing, detectable


def _same_logprobs(engine, seq, adapter_name: str) -> bool:
    """Whether ``seq``'s reported logprobs are a forward pass's with adapter ``adapter_name``."""
    import torch

    bank = engine.lora
    adapter = bank.acquire(adapter_name)
    try:
        tokens = seq.prompt_ids + seq.output_ids
        result = engine.scheduler.call(lambda s: _reference(s, bank, adapter, tokens)).result(timeout=600)
    finally:
        bank.release(adapter)
    expected = torch.stack([result[i - 1, tokens[i]] for i in range(len(seq.prompt_ids), len(tokens))])
    return torch.allclose(expected, torch.tensor(seq.output_logprobs), atol=1e-3)


def _reference(scheduler, bank, adapter, tokens):
    with bank.rows([adapter]):
        return scheduler.runner.full_logprobs(tokens)


def _full_activation(engine, published: dict, command: LoraBench) -> float:
    """Today's full-weight activation across in-flight requests: pull (no pause), then one call."""
    from miles_disagg.engines.builtin import control_bodies, one_call

    in_flight = _submit(engine, [None] * max(1, command.requests // 4), 4 * command.max_new_tokens)
    local = str(engine.config.local_checkpoint_dir)
    engine.updates.pull_weights(control_bodies.PullWeights(target_version=1, source_dir=str(published["full_store"]),
                                                           local_checkpoint_dir=local))
    while min(len(s.times) for s in in_flight) < command.max_new_tokens:
        time.sleep(0.005)
    started = time.perf_counter()
    one_call.activate_here(engine, one_call.ActivateWeights(weight_version="1", model_path=local,
                                                            pause_mode="retract", flush_cache=True))
    window = (started, time.perf_counter())
    _wait(in_flight)
    return _stall(in_flight, window)
