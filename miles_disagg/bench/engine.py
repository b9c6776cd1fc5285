"""``miles-disagg bench engine``: built-in engine throughput and activation pause.

Makes a random Qwen3 (character vocabulary; default ~100M parameters, `--hidden-size`, `--num-layers`) in a temp dir, starts the
built-in engine on it as a subprocess, and measures over HTTP:

* tokens/s at concurrency 1 and 16 (``/generate``, ``ignore_eos``, fixed lengths),
  against sequential ``transformers`` ``generate`` on the same model in this process;
* the activation pause for a staged update (``/pull_weights`` then
  ``/update_weights_from_disk`` naming the pulled version) against a disk reload of
  the same checkpoint; both pauses are the engine's own measurement of the time its
  scheduler stood still (``pause_ms`` in the response), so they depend little on what else
  the machine runs. ``--rounds`` activations of each kind (at least 10 by default): the median
  and the 90th percentile are reported, so one slow first activation does not decide the figure.

Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.common import print_result, progress, qwen3_shape, work_dir
from miles_disagg.bench.http_engine import engine_throughput
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag


@dataclass(kw_only=True)
class EngineBench:
    """built-in engine throughput and activation pause"""

    json: bool = flag(False, "Print the result as JSON (always on; kept for scripts).")
    hidden_size: int = flag(768, "Hidden size of the random Qwen3 (a multiple of 64; 768: ~100M parameters).")
    num_layers: int = flag(12, "Layers of the random Qwen3.")
    max_new_tokens: int = flag(64, "Tokens generated per request.")
    prompt_tokens: int = flag(16, "Tokens per prompt.")
    concurrency: int = flag(16, "Requests in flight at once (the c16 measurement).")
    rounds: int = flag(10, "Activations measured per kind (median and 90th percentile reported).")
    work_dir: Path | None = flag(None, "Keep the model and store here (default: a temp dir).")

    def __post_init__(self) -> None:
        qwen3_shape(self.hidden_size, self.num_layers)  # ValueError naming the flag
        if self.rounds < 1:
            raise ValueError(f"--rounds must be at least 1, got {self.rounds}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, EngineBench)


_progress = progress("engine")


def run(args: argparse.Namespace) -> int:
    command = config_from_args(EngineBench, args)
    with work_dir("engine", command.work_dir) as root:
        return print_result(_bench(root, command))


def _bench(root: Path, command: EngineBench) -> dict:
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    _progress(f"writing a random Qwen3 (hidden {command.hidden_size}, {command.num_layers} layers)")
    model_dir = make_tiny_qwen3(root / "model", **qwen3_shape(command.hidden_size, command.num_layers))
    prompts = [[(7 * i + j) % 90 + 3 for j in range(command.prompt_tokens)] for i in range(command.concurrency)]
    num_params, sequential = _sequential_generate(model_dir, prompts, command.max_new_tokens)
    engine = _Engine(model_dir, root)
    try:
        c1 = engine_throughput(engine, prompts[:4], command.max_new_tokens, concurrency=1)
        c16 = engine_throughput(engine, prompts, command.max_new_tokens, concurrency=command.concurrency)
        staged, disk, prepare = _activation_pauses(engine, model_dir, root, command.rounds)
    finally:
        engine.stop()
    return {
        "model_params": num_params,
        "max_new_tokens": command.max_new_tokens,
        "concurrency": command.concurrency,
        "tokens_per_s_c1": round(c1, 2),
        "tokens_per_s_c16": round(c16, 2),
        "tokens_per_s_sequential": round(sequential, 2),
        "throughput_ratio": round(c16 / sequential, 3),
        "activations_per_kind": len(staged),
        "staged_pause_ms": round(statistics.median(staged), 3),
        "staged_pause_ms_p90": round(p90(staged), 3),
        "disk_reload_ms": round(statistics.median(disk), 3),
        "disk_reload_ms_p90": round(p90(disk), 3),
        "pause_ratio": round(statistics.median(disk) / max(statistics.median(staged), 1e-6), 1),
        "staged_prepare_ms": round(statistics.median(prepare), 1),
        "staged_pause_ms_all": staged,
        "disk_reload_ms_all": disk,
    }


def p90(values: list[float]) -> float:
    """The 90th percentile (nearest rank: the smallest value at least 90% of ``values`` do not exceed)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]


def _sequential_generate(model_dir: Path, prompts: list[list[int]], max_new: int) -> tuple[int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_params = sum(p.numel() for p in model.parameters())
    kwargs = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(torch.tensor([prompts[0]]), **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        _progress(f"sequential transformers generate: {len(prompts)} x {max_new} tokens")
        start = time.perf_counter()
        for prompt in prompts:
            model.generate(torch.tensor([prompt]), **kwargs)
        elapsed = time.perf_counter() - start
    del model
    return num_params, len(prompts) * max_new / elapsed


class _Engine:
    """A launched engine and an HTTP client for it."""

    def __init__(self, model_dir: Path, root: Path):
        import httpx

        from miles_disagg.engines.launch import launch_engine

        _progress("starting the built-in engine")
        self.launched = launch_engine(model_dir, log_path=root / "engine.log",
                                      extra_args=("--max-running-requests", "64", "--weight-store-dir", str(root / "store"),
                                                  "--local-checkpoint-dir", str(root / "local" / "ckpt")))
        self.client = httpx.Client(base_url=self.launched.url, timeout=600.0)

    def post(self, path: str, body: dict):
        return self.client.post(path, json=body)

    def generate(self, body: dict) -> dict:
        return _ok(self.post("/generate", body))

    def stop(self) -> None:
        self.client.close()
        self.launched.stop()


def _activation_pauses(engine, model_dir: Path, root: Path, rounds: int):
    import torch

    from miles_disagg.weights.publisher import DeltaPublisher

    store, local = root / "store", root / "local" / "ckpt"
    local.parent.mkdir(parents=True, exist_ok=True)
    publisher = DeltaPublisher(store, base_dir=model_dir)
    publisher.capture_baseline()
    tensors = _load(model_dir)
    staged, disk, prepare = [], [], []
    try:
        for round_index in range(rounds):
            generator = torch.Generator().manual_seed(round_index)
            for name, t in tensors.items():  # every tensor changes: the staged swap covers the whole model
                tensors[name] = t + 1e-3 * torch.randn(t.shape, generator=generator)
            _progress(f"publishing version {round_index + 1} (all tensors changed)")
            version = publisher.publish(tensors.items()).ref.version
            start = time.perf_counter()
            pulled = _ok(engine.post("/pull_weights", {"target_version": version, "source_dir": str(store),
                                                        "local_checkpoint_dir": str(local)}))
            prepare.append((time.perf_counter() - start) * 1e3)
            _progress(f"pulled v{version}: {pulled['num_tensors_staged']} tensors staged")
            activated = _ok(engine.post("/update_weights_from_disk",
                                        {"model_path": str(local), "weight_version": str(version)}))
            assert activated["activation"] == "staged", activated
            staged.append(activated["pause_ms"])
            reloaded = _ok(engine.post("/update_weights_from_disk",
                                       {"model_path": str(local), "weight_version": str(version)}))
            assert reloaded["activation"] == "disk", reloaded
            disk.append(reloaded["pause_ms"])
            _progress(f"staged pause {staged[-1]:.2f} ms, disk reload {disk[-1]:.1f} ms")
    finally:
        publisher.close()
    return staged, disk, prepare


def _ok(response) -> dict:
    if response.status_code != 200:
        raise RuntimeError(f"{response.request.url}: {response.status_code} {response.text}")
    return response.json()


def _load(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors
