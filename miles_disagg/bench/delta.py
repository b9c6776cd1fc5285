"""``miles-disagg bench delta``: this project's disk-delta codec vs the reference codec.

Model: synthetic bf16 tensors with LLM shapes (embedding, per-layer attention with GQA,
gated MLP, norms, LM head), N(0, 0.02). Update: one AdamW step on an fp32 master copy
(first-step Adam moves every weight by ``lr`` in the gradient's sign, plus weight decay
0.1) re-rounded to bf16, so only a fraction of bf16 elements change.

Codecs, both over ``--workers`` threads:

* ours: the default codec (``mixed``: per tensor the smallest of XOR byte planes, sparse
  gap-coded positions + XOR values, and overwrite; 4 MiB chunks, zstd-1, xxh3-128), decoding
  into place;
* reference: XOR + zstd level 1 per whole tensor, no filter (the plain disk-delta format),
  a thread pool over tensors.

``--moe``: the same measurements on a MoE-shaped model whose update leaves the experts that received
no token bit-identical (:mod:`miles_disagg.bench.delta_moe`), printed as ``{"dense": ..., "moe": ...}``;
the MoE figures add the fraction of tensors skipped (no payload) and the routing of the step.

``--fp8``: the same AdamW updates published as BF16 and as blockwise-FP8 versions across learning rates,
dense and MoE (:mod:`miles_disagg.bench.delta_fp8`).

``--densities``: realistic AdamW deltas (:mod:`miles_disagg.bench.adamw_deltas`) at learning rates
calibrated to ``--density-targets`` (percent of elements changed), with a third codec, the sparse
positions+values format NeMo-RL and slime describe, and the order-0 entropy bound beside ours
(:mod:`miles_disagg.bench.delta_densities`).

Prints one JSON object on stdout; progress goes to stderr. GB/s are model bytes per second.
"""

from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from miles_disagg.bench.codecs import Ours, Reference, best_s, entropy_bound_bytes
from miles_disagg.bench.common import progress
from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import flag
from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes

_log = progress("delta")


@dataclass(kw_only=True)
class DeltaBench:
    """disk-delta codec: ours vs the reference codec"""

    size_mb: float = flag(512.0, "Model size in MiB.")
    lr: float = flag(1e-5, "AdamW learning rate of the simulated step.")
    workers: int = flag(2, "Worker threads for both codecs.")
    repeat: int = flag(5, "Interleaved timed rounds; the best of each is reported.")
    seed: int = flag(0, "Seed of the synthetic model.")
    json: bool = flag(False, "Print the JSON object only (always JSON on stdout).")
    moe: bool = flag(False, "Also measure a MoE-shaped model in which some experts received no token.")
    num_experts: int = flag(64, "--moe: experts per layer.")
    experts_per_token: int = flag(8, "--moe: experts each token is routed to.")
    tokens_per_step: int = flag(64, "--moe: tokens routed in the simulated step (fewer: more experts untouched).")
    densities: bool = flag(False, "Measure ours, the reference and a sparse positions+values codec on AdamW deltas "
                                  "at each of --density-targets.")
    density_targets: list[float] = flag([0.3, 1.0, 3.0, 10.0, 30.0], "--densities: percent of elements changed.")
    fp8: bool = flag(False, "Publish the same AdamW updates as BF16 and as blockwise-FP8 versions across "
                            "--fp8-learning-rates (dense and MoE shapes): changed values and blocks, wire, speed.")
    fp8_learning_rates: list[float] = flag([1e-7, 3e-7, 1e-6, 3e-6, 1e-5], "--fp8: the learning rates.")

    def __post_init__(self) -> None:
        if self.size_mb <= 0 or self.workers < 1 or self.lr < 0:
            raise ValueError("--size-mb must be > 0, --workers >= 1 and --lr >= 0")
        if not 1 <= self.experts_per_token <= self.num_experts or self.tokens_per_step < 0:
            raise ValueError("--experts-per-token must be in [1, --num-experts] and --tokens-per-step >= 0")
        if not self.density_targets or not all(0 < t < 100 for t in self.density_targets):
            raise ValueError("--density-targets must be percentages in (0, 100)")
        if not self.fp8_learning_rates or not all(lr > 0 for lr in self.fp8_learning_rates):
            raise ValueError("--fp8-learning-rates must be positive")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, DeltaBench)


def model_shapes(size_bytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3 bf16 shapes (3 layers, heads of 16, GQA 4:1) whose total is close to ``size_bytes``."""
    hidden = max(64, int(round(math.sqrt(size_bytes / 128.5) / 64)) * 64)
    return qwen3_tensor_shapes({"vocab_size": hidden * 16, "hidden_size": hidden, "num_hidden_layers": 3,
                                "intermediate_size": int(hidden * 2.75) // 64 * 64, "head_dim": 16,
                                "num_attention_heads": hidden // 16, "num_key_value_heads": hidden // 64})


def make_model(size_mb: float, lr: float, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(old, new) bf16 byte arrays per tensor: N(0, 0.02) and one AdamW step later."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    old, new = {}, {}
    for name, shape in model_shapes(int(size_mb * 1024 * 1024)):
        master = torch.randn(shape, generator=gen) * 0.02
        if name.endswith("norm.weight"):
            master += 1.0
        sign = torch.randint(0, 2, shape, generator=gen, dtype=torch.int8).float().mul_(2).sub_(1)
        old[name] = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
        master.sub_(lr * (sign + 0.1 * master))
        new[name] = master.bfloat16().view(torch.uint8).reshape(-1).numpy()
    return old, new


def memcpy_gbps(pool: ThreadPoolExecutor, new: dict[str, np.ndarray], repeat: int) -> float:
    dst = {n: np.empty_like(a) for n, a in new.items()}
    total = sum(a.nbytes for a in new.values())
    seconds = best_s(lambda: list(pool.map(lambda n: np.copyto(dst[n], new[n]), new)), repeat)
    return total / seconds / 1e9


def run(args: argparse.Namespace) -> int:
    command = config_from_args(DeltaBench, args)
    if command.fp8:
        from miles_disagg.bench.delta_fp8 import run_fp8

        result = run_fp8(command)
        print(json.dumps(result, indent=None if command.json else 2))
        return 0 if result["round_trip_exact"] else 1
    if command.densities:
        from miles_disagg.bench.delta_densities import run_densities

        result = run_densities(command)
        print(json.dumps(result, indent=None if command.json else 2))
        return 0 if result["round_trip_exact"] else 1
    _log(f"building a {command.size_mb:g} MiB bf16 model and one AdamW step (lr {command.lr:g})")
    result = measure(command, *make_model(command.size_mb, command.lr, command.seed))
    if command.moe:
        from miles_disagg.bench.delta_moe import make_moe_model

        _log(f"building a {command.size_mb:g} MiB bf16 MoE model ({command.num_experts} experts, top "
             f"{command.experts_per_token}, {command.tokens_per_step} tokens) and one step")
        old, new, routing = make_moe_model(command.size_mb, command.lr, command.seed, command.num_experts,
                                           command.experts_per_token, command.tokens_per_step)
        result = {"dense": result, "moe": {**measure(command, old, new), **routing}}
        exact = result["dense"]["round_trip_exact"] and result["moe"]["round_trip_exact"]
    else:
        exact = result["round_trip_exact"]
    print(json.dumps(result, indent=None if command.json else 2))
    return 0 if exact else 1


def measure(command: DeltaBench, old: dict[str, np.ndarray], new: dict[str, np.ndarray]) -> dict:
    """Both codecs on one (old, new) model: the figures of the JSON object."""
    total = sum(a.nbytes for a in new.values())
    changed = sum(int(np.count_nonzero(old[n] != new[n])) for n in new)
    with ThreadPoolExecutor(command.workers) as pool:
        _log("memcpy")
        memcpy = memcpy_gbps(pool, new, command.repeat)
        ours, reference = Ours(pool, old, new), Reference(pool, old, new)
        for round_index in range(max(1, command.repeat)):  # interleaved so machine noise hits both alike
            _log(f"round {round_index + 1}/{command.repeat}: reference, then ours")
            reference.timed_round()
            ours.timed_round()
        exact = ours.exact() and reference.exact()
        ours_report, reference_report = ours.report(), reference.report()
        skipped = len(new) - len(ours.encoded)
    _log("entropy bound")
    result = {
        "model_bytes": total,
        "num_tensors": len(new),
        "lr": command.lr,
        "workers": command.workers,
        "density": changed / total,
        "entropy_bound_bytes": entropy_bound_bytes(old, new),
        "memcpy_gbps": memcpy,
        "ours": ours_report,
        "reference": reference_report,
        "wire_ratio": ours_report["wire_bytes"] / max(reference_report["wire_bytes"], 1),
        "encode_speedup": ours_report["encode_gbps"] / reference_report["encode_gbps"],
        "decode_speedup": ours_report["decode_gbps"] / reference_report["decode_gbps"],
        "wire_fraction": ours_report["wire_bytes"] / total,
        "tensors_skipped_fraction": skipped / len(new),
        "round_trip_exact": bool(exact),
    }
    return result
