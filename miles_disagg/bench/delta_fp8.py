"""``miles-disagg bench delta --fp8``: the same AdamW-derived updates published as BF16 versions and as
blockwise-FP8 versions (what FP8 engines serve), across learning rates, on dense and MoE shapes.

Model: Qwen3 / Qwen3-MoE shapes (:func:`fp8_shapes`) whose embedding and head take the share of the
model they take in Qwen3-8B (15%) and Qwen3-30B-A3B (2%), so the tensors that stay BF16 in an FP8
version weigh what they weigh in the real checkpoints. Update: the last of a few AdamW steps on fp32
masters (:mod:`miles_disagg.bench.adamw_deltas`: frozen embeddings, experts without tokens untouched).
The FP8 version of each state is :func:`miles_disagg.models.fp8.quantize` of every weight the rule
quantizes (128x128 blocks), the publisher's own rule.

Per learning rate and shape: elements changed (BF16, and FP8 values), blocks whose scale changed,
wire of ours (the ``mixed`` codec) and of the reference (XOR + zstd-1 per tensor) on each version,
encode/decode speed per byte of each version, interleaved over ``--repeat`` rounds (best round wins).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from miles_disagg.bench.adamw_deltas import AdamWRun, make_adamw_model
from miles_disagg.bench.codecs import Ours, Reference
from miles_disagg.bench.common import progress
from miles_disagg.models.fp8 import DEFAULT_BLOCK, is_quantized_weight, quantize, scale_name
from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes

_log = progress("delta")
LEARNING_RATES = (1e-7, 3e-7, 1e-6, 3e-6, 1e-5)
EMBEDDING_SHARE = {"dense": 0.15, "moe": 0.02}  # embedding + head: Qwen3-8B, Qwen3-30B-A3B
MOE_EXPERTS = 16
WIRE_VS_BF16_TARGET, WIRE_VS_REFERENCE_TARGET, SPARSE_BAND = 0.12, 0.85, 0.01


def fp8_shapes(size_bytes: int, kind: str) -> list[tuple[str, tuple[int, ...]]]:
    """bf16 shapes of a 4-layer Qwen3 (``dense``) or Qwen3-MoE (``moe``, 16 experts) of about
    ``size_bytes``, the vocabulary sized so embedding + head are :data:`EMBEDDING_SHARE` of it."""
    layers, share = 4, EMBEDDING_SHARE[kind]
    per_layer_h2 = 4.5 + (3 * 3.0 if kind == "dense" else 3 * 0.375 * MOE_EXPERTS)  # attention + MLP, in hidden^2
    body_h2 = layers * per_layer_h2
    vocab_over_hidden = share * body_h2 / (2 * (1 - share))
    hidden = max(128, int(round(np.sqrt(size_bytes / 2 / (body_h2 + 2 * vocab_over_hidden)) / 128)) * 128)
    config = {"vocab_size": max(128, int(vocab_over_hidden * hidden) // 64 * 64), "hidden_size": hidden,
              "num_hidden_layers": layers, "head_dim": 128, "num_attention_heads": 2 * hidden // 128,
              "num_key_value_heads": max(1, hidden // 512), "intermediate_size": 3 * hidden}
    if kind == "moe":
        config.update(num_experts=MOE_EXPERTS, moe_intermediate_size=max(16, int(hidden * 0.375) // 16 * 16))
    return qwen3_tensor_shapes(config)


def fp8_version(state: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The FP8 form of a bf16 state (byte arrays): each quantized weight's FP8 bytes and its scale."""
    import torch

    out = {}
    for name, data in state.items():
        if not is_quantized_weight(name, shapes[name]):
            out[name] = data
            continue
        weight = torch.from_numpy(data.copy()).view(torch.bfloat16).reshape(shapes[name])
        q, scale = quantize(weight, DEFAULT_BLOCK)
        out[name] = q.view(torch.uint8).reshape(-1).numpy()
        out[scale_name(name)] = scale.view(torch.uint8).reshape(-1).numpy()
    return out


def _itemsizes(fp8: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    sizes = {}
    for name, data in fp8.items():
        if name.endswith("_scale_inv"):
            sizes[name] = 4
        else:
            sizes[name] = 1 if is_quantized_weight(name, shapes[name]) else 2
    return sizes


def _changed(old: dict[str, np.ndarray], new: dict[str, np.ndarray], names: list[str], itemsize: int) -> float:
    dtype = {1: "u1", 2: "<u2", 4: "<u4"}[itemsize]
    changed = sum(int(np.count_nonzero(old[n].view(dtype) != new[n].view(dtype))) for n in names)
    return changed / max(1, sum(new[n].nbytes // itemsize for n in names))


def _time(pool: ThreadPoolExecutor, old, new, repeat: int, itemsizes: dict[str, int] | None) -> dict:
    ours, reference = Ours(pool, old, new, itemsizes=itemsizes), Reference(pool, old, new)
    for _ in range(max(1, repeat)):
        reference.timed_round()
        ours.timed_round()
    return {"ours": ours.report(), "reference": reference.report(), "exact": ours.exact() and reference.exact()}


def measure_lr(command, kind: str, lr: float) -> dict:
    shapes = fp8_shapes(int(command.size_mb * 1024 * 1024), kind)
    run = AdamWRun(num_experts=MOE_EXPERTS if kind == "moe" else 0)
    _log(f"fp8 {kind}: AdamW step at lr {lr:g}")
    old, new = make_adamw_model(command.size_mb, lr, command.seed, run, shapes=shapes)
    by_name = dict(shapes)
    old8, new8 = fp8_version(old, by_name), fp8_version(new, by_name)
    sizes = _itemsizes(new8, by_name)
    fp8_names = [n for n, s in sizes.items() if s == 1]
    scales = [n for n, s in sizes.items() if s == 4]
    with ThreadPoolExecutor(command.workers) as pool:
        bf16 = _time(pool, old, new, command.repeat, None)
        fp8 = _time(pool, old8, new8, command.repeat, sizes)
    fp8_wire, bf16_wire = fp8["ours"]["wire_bytes"], bf16["ours"]["wire_bytes"]
    return {
        "kind": kind, "lr": lr,
        "bf16_bytes": sum(a.nbytes for a in new.values()), "fp8_bytes": sum(a.nbytes for a in new8.values()),
        "bf16_elements_changed": _changed(old, new, list(new), 2),
        "fp8_values_changed": _changed(old8, new8, fp8_names, 1),
        "fp8_blocks_rescaled": _changed(old8, new8, scales, 4),
        "bf16": {k: v for k, v in bf16.items() if k != "exact"}, "fp8": {k: v for k, v in fp8.items() if k != "exact"},
        "fp8_wire_vs_bf16": fp8_wire / max(bf16_wire, 1),
        "fp8_wire_vs_reference": fp8_wire / max(fp8["reference"]["wire_bytes"], 1),
        "fp8_encode_vs_bf16": fp8["ours"]["encode_gbps"] / bf16["ours"]["encode_gbps"],
        "fp8_decode_vs_bf16": fp8["ours"]["decode_gbps"] / bf16["ours"]["decode_gbps"],
        "round_trip_exact": bool(bf16["exact"] and fp8["exact"]),
    }


def targets_met(rows: list[dict]) -> dict[str, bool]:
    at_1e6 = [r for r in rows if r["lr"] == 1e-6]
    sparse = [r for r in rows if r["fp8_values_changed"] < SPARSE_BAND]
    return {
        "wire_vs_bf16_at_lr_1e-6": bool(at_1e6) and all(r["fp8_wire_vs_bf16"] <= WIRE_VS_BF16_TARGET for r in at_1e6),
        "wire_not_above_reference": all(r["fp8_wire_vs_reference"] <= 1.0 for r in rows),
        "wire_vs_reference_under_1pct": all(r["fp8_wire_vs_reference"] <= WIRE_VS_REFERENCE_TARGET for r in sparse),
        "speed_per_byte_not_below_bf16": all(r["fp8_encode_vs_bf16"] >= 1.0 and r["fp8_decode_vs_bf16"] >= 1.0
                                             for r in rows),
    }


def run_fp8(command) -> dict:
    rows = [measure_lr(command, kind, lr) for kind in ("dense", "moe") for lr in command.fp8_learning_rates]
    return {"size_mb": command.size_mb, "workers": command.workers, "repeat": command.repeat, "seed": command.seed,
            "block": list(DEFAULT_BLOCK), "embedding_share": EMBEDDING_SHARE, "rows": rows,
            "targets_met": targets_met(rows), "round_trip_exact": all(r["round_trip_exact"] for r in rows)}
