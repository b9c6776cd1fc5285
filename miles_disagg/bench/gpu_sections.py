"""The sections of ``scripts/gpu_check.sh`` (run one per process by :mod:`miles_disagg.bench.gpu_check`).

Each section takes a :class:`Shapes` (real GPU shapes, or small ones for ``--cpu``) and a work
directory, and returns a JSON-able dict. Nothing here imports Ray or SGLang: the GPU machine
has neither.

* ``engine``: the built-in engine on the device (bf16 on CUDA) with a Qwen3-0.6B-shaped random
  model: tokens/s at concurrency 1 and 16, and the staged activation pause.
* ``fsdp``: one FSDP2 training step (``--train-backend fsdp``) on samples the engine generated,
  and the train-vs-engine logprob difference on the same weights (the step's
  ``train/train_rollout_logprob_abs_diff``: the trainer's logprobs before the step against the
  engine's for the same tokens).
* ``megatron``: one step of the megatron backend (a megatron-core ``GPTModel`` forward and
  backward, then the optimizer) if megatron-core is importable.
* ``delta``: the disk-delta codec on a Qwen3-4B-shaped (about 8 GB bf16) random model and one
  AdamW-like step, with a worker per core: encode and decode GB/s, wire ratio, exactness.
* ``moe``: a tiny Qwen3-MoE served by the built-in engine with routed experts returned, and one
  megatron step replaying them (:mod:`miles_disagg.bench.gpu_moe`; parts this tree lacks are skipped).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.bench.http_engine import HttpEngine, engine_throughput

QWEN3_0_6B = dict(hidden_size=1024, num_hidden_layers=28, intermediate_size=3072, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936)
QWEN3_4B = dict(hidden_size=2560, num_hidden_layers=36, intermediate_size=9728, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936)
SMALL = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)
MEGATRON_GPU = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=3072, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=64)


@dataclass(frozen=True)
class Shapes:
    """What a section runs on: the device, the engine/trainer model, the codec model."""

    device: str
    engine_model: dict
    megatron_model: dict
    delta_model: dict
    max_new_tokens: int
    concurrency: int

    @classmethod
    def for_run(cls, cpu: bool) -> "Shapes":
        if cpu:
            return cls("cpu", SMALL, SMALL, {**SMALL, "vocab_size": 4096}, max_new_tokens=8, concurrency=4)
        return cls("cuda", QWEN3_0_6B, MEGATRON_GPU, QWEN3_4B, max_new_tokens=64, concurrency=16)

    @property
    def engine_dtype(self) -> str:
        return "bfloat16" if self.device == "cuda" else "float32"


def _model_dir(work: Path, shapes: Shapes) -> Path:
    """The engine/trainer model, made once per work dir (both the engine and fsdp sections use it)."""
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    model_dir = work / "model-engine"
    if not (model_dir / "config.json").is_file():
        make_tiny_qwen3(model_dir, dtype=shapes.engine_dtype, **shapes.engine_model)
    return model_dir


def _start_engine(model_dir: Path, work: Path, shapes: Shapes):
    from miles_disagg.engines.launch import launch_engine

    return launch_engine(model_dir, log_path=work / "engine.log", startup_timeout_s=180,
                         extra_args=["--device", shapes.device, "--dtype", shapes.engine_dtype,
                                     # the roots it may read weights from and write its checkpoint under
                                     "--weight-store-dir", str(work / "store"),
                                     "--local-checkpoint-dir", str(work / "local" / "ckpt")])


# --------------------------------------------------------------------------- engine


def section_engine(shapes: Shapes, work: Path) -> dict:
    start = time.perf_counter()
    model_dir = _model_dir(work, shapes)
    made_s = time.perf_counter() - start
    launched = _start_engine(model_dir, work, shapes)
    engine = HttpEngine(launched)
    try:
        prompts = [[(7 * i + j) % 90 + 3 for j in range(16)] for i in range(shapes.concurrency)]  # < any vocab here
        c1 = engine_throughput(engine, prompts[:2], shapes.max_new_tokens, 1)
        c16 = engine_throughput(engine, prompts, shapes.max_new_tokens, shapes.concurrency)
        pauses = _staged_activation(engine, model_dir, work)
        info = engine.get("/server_info")
    finally:
        engine.stop()
    return {"device": info.get("device"), "dtype": info.get("dtype"), "params": _num_params(shapes.engine_model),
            "model_made_s": round(made_s, 1), "tokens_per_s_c1": round(c1, 1),
            f"tokens_per_s_c{shapes.concurrency}": round(c16, 1), "throughput_ratio": round(c16 / c1, 2),
            **pauses}


def _staged_activation(engine: "HttpEngine", model_dir: Path, work: Path) -> dict:
    """Publish a version changing every tensor, pull it while serving, activate it (staged), then
    reload the same from disk: the engine's own pause measurements (``pause_ms``)."""
    import torch
    from safetensors.torch import load_file

    from miles_disagg.weights.publisher import DeltaPublisher

    store, local = work / "store", work / "local" / "ckpt"
    local.parent.mkdir(parents=True, exist_ok=True)
    publisher = DeltaPublisher(store, base_dir=model_dir)
    try:
        publisher.capture_baseline()
        tensors = {}
        for file in sorted(model_dir.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        generator = torch.Generator().manual_seed(0)
        changed = {n: (t.float() + 1e-3 * torch.randn(t.shape, generator=generator)).to(t.dtype)
                   for n, t in tensors.items()}
        version = publisher.publish(changed.items()).ref.version
    finally:
        publisher.close()
    start = time.perf_counter()
    engine.check(engine.post("/pull_weights", {"target_version": version, "source_dir": str(store),
                                                "local_checkpoint_dir": str(local)}))
    prepare_ms = (time.perf_counter() - start) * 1e3
    body = {"model_path": str(local), "weight_version": str(version)}
    staged = engine.check(engine.post("/update_weights_from_disk", body))
    disk = engine.check(engine.post("/update_weights_from_disk", body))
    return {"prepare_ms": round(prepare_ms, 1), "staged_pause_ms": staged["pause_ms"],
            "staged_activation": staged["activation"], "disk_reload_pause_ms": disk["pause_ms"]}


def _num_params(shape: dict) -> int:
    h, layers, inter = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * inter + 2 * h + 2 * shape["head_dim"]
    return layers * per_layer + 2 * shape.get("vocab_size", 0) * h + h


# --------------------------------------------------------------------------- training


def _samples_from_engine(model_dir: Path, work: Path, shapes: Shapes, count: int = 8):
    """``count`` samples the engine generated (temperature 1, its logprobs), random rewards, one group."""
    import random

    from miles_disagg.samples import Group, Sample

    engine = HttpEngine(_start_engine(model_dir, work, shapes))
    rng = random.Random(0)
    try:
        prompt = [rng.randrange(3, 93) for _ in range(16)]
        answers = engine.generate({"input_ids": [prompt] * count, "return_logprob": True, "sampling_params": {
            "max_new_tokens": shapes.max_new_tokens, "temperature": 1.0, "ignore_eos": True}})
    finally:
        engine.stop()
    samples = [Sample(prompt_ids=prompt, response_ids=a["output_ids"],
                      response_logprobs=[float(t[0]) for t in a["meta_info"]["output_token_logprobs"]],
                      reward=rng.random()) for a in answers]
    return [Group(prompt_index=0, samples=samples)]


def _train_one_step(backend_name: str, model_dir: Path, groups) -> dict:
    from miles_disagg.config.training import TrainConfig
    from miles_disagg.distributed import init_distributed
    from miles_disagg.net.process import free_port
    from miles_disagg.trainer.sequence_advantages import assign_advantages
    from miles_disagg.trainer.backends import make_backend

    config = TrainConfig(train_backend=backend_name, lr=1e-6, micro_batch_size=4, global_batch_size=8, seed=1)
    start = time.perf_counter()
    init_distributed(0, 1, "127.0.0.1", free_port("127.0.0.1"))
    backend = make_backend(config, str(model_dir), rank=0, world_size=1)
    built = time.perf_counter()
    samples = assign_advantages(groups, config)
    result = backend.train([samples])
    step = result.steps[0]
    return {"backend": backend_name, "build_s": round(built - start, 1), "step_s": round(time.perf_counter() - built, 2),
            "loss": step.get("train/loss"), "grad_norm": step.get("train/grad_norm"),
            "train_vs_engine_logprob_abs_diff": result.rollout.get("train/train_rollout_logprob_abs_diff")}


def section_fsdp(shapes: Shapes, work: Path) -> dict:
    import torch

    model_dir = _model_dir(work, shapes)
    groups = _samples_from_engine(model_dir, work, shapes)
    result = _train_one_step("fsdp", model_dir, groups)
    if torch.cuda.is_available():
        result["fsdp2"] = True
        result["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return result


def section_megatron(shapes: Shapes, work: Path) -> dict:
    import importlib.util

    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3
    from miles_disagg.samples import Group, Sample

    if importlib.util.find_spec("megatron.core") is None:
        return {"skipped": "megatron-core is not installed (carry its wheel to run this section)"}
    model_dir = work / "model-megatron"
    if not (model_dir / "config.json").is_file():
        make_tiny_qwen3(model_dir, **shapes.megatron_model)
    length = shapes.max_new_tokens
    samples = [Sample(prompt_ids=list(range(3, 19)), response_ids=[(5 * i + j) % 100 + 3 for j in range(length)],
                      response_logprobs=[0.0] * length, reward=float(i % 2)) for i in range(8)]
    result = _train_one_step("megatron", model_dir, [Group(prompt_index=0, samples=samples)])
    result.pop("train_vs_engine_logprob_abs_diff", None)  # these samples came from no engine
    return result


# --------------------------------------------------------------------------- delta codec


def section_delta(shapes: Shapes, work: Path) -> dict:
    import numpy as np

    from miles_disagg.bench.codecs import Ours

    workers = os.cpu_count() or 1
    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        old, new = _qwen3_model(pool, shapes.delta_model)
        made = time.perf_counter()
        ours = Ours(pool, old, new)
        ours.timed_round()
        exact = ours.exact()
        report = ours.report()
    total = sum(a.nbytes for a in new.values())
    changed = sum(int(np.count_nonzero(old[n] != new[n])) for n in new) / total
    return {"model_mb": round(total / 1e6, 1), "tensors": len(new), "workers": workers,
            "model_made_s": round(made - start, 1), "changed_byte_fraction": round(changed, 3),
            "encode_gbps": round(report["encode_gbps"], 2), "decode_gbps": round(report["decode_gbps"], 2),
            "wire_ratio": round(report["wire_bytes"] / total, 3), "round_trip_exact": exact}


CHUNK = 1 << 24  # elements per generation task


def _qwen3_model(pool: ThreadPoolExecutor, shape: dict):
    """(old, new) bf16 bytes per tensor of a Qwen3 of ``shape``: N(0, 0.02) (norms around 1), and
    one AdamW-like step later (lr 1e-5 along a random sign, weight decay 0.1); made in parallel."""
    import numpy as np

    from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes

    shapes = qwen3_tensor_shapes({**shape, "tie_word_embeddings": True})  # Qwen3-4B ties lm_head to the embedding
    old = {n: np.empty(int(np.prod(s)) * 2, dtype=np.uint8) for n, s in shapes}
    new = {n: np.empty_like(old[n]) for n, _ in shapes}
    tasks = [(i, n, lo, min(lo + CHUNK, int(np.prod(s)))) for i, (n, s) in enumerate(shapes)
             for lo in range(0, int(np.prod(s)), CHUNK)]
    list(pool.map(lambda t: _fill(old, new, *t), tasks))
    return old, new


def _fill(old, new, index: int, name: str, lo: int, hi: int) -> None:
    import torch

    generator = torch.Generator().manual_seed(index * 1_000_003 + lo)
    master = torch.randn(hi - lo, generator=generator) * 0.02
    if name.endswith("norm.weight"):
        master += 1.0
    sign = torch.randint(0, 2, (hi - lo,), generator=generator, dtype=torch.int8).float().mul_(2).sub_(1)
    old[name][2 * lo:2 * hi] = master.bfloat16().view(torch.uint8).numpy()
    master.sub_(1e-5 * (sign + 0.1 * master))
    new[name][2 * lo:2 * hi] = master.bfloat16().view(torch.uint8).numpy()


def section_moe(shapes: Shapes, work: Path) -> dict:
    """A tiny Qwen3-MoE: the built-in engine returning routed experts, one megatron step replaying them
    (:mod:`miles_disagg.bench.gpu_moe`)."""
    from miles_disagg.bench.gpu_moe import section_moe as run

    return run(shapes, work)


SECTIONS = {"engine": section_engine, "fsdp": section_fsdp, "megatron": section_megatron, "delta": section_delta,
            "moe": section_moe}
