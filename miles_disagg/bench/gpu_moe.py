"""The ``moe`` section of ``scripts/gpu_check.sh``: a tiny Qwen3-MoE end to end on one device.

* the built-in engine serves a random Qwen3-MoE (bf16 on CUDA) started with
  ``--enable-return-routed-experts``: tokens/s at concurrency 1 and N, and every answer's
  ``meta_info["routed_experts"]`` decoded by the rollout's own decoder (one row per position but
  the last, -1 exactly on the dense layers, experts in range);
* one step of the megatron backend on those samples with ``--use-rollout-routing-replay``: its
  loss, ``train/routing_replay_match`` (1.0 when the trainer used the engine's experts),
  ``train/routing_agreement`` and the train-vs-engine logprob difference.

The model family and the Megatron MoE layers come with the MoE work on other branches: each
part reports ``skipped`` with the reason where this tree does not have them yet
(``make_tiny_qwen3`` without ``num_experts``; a megatron converter without ``qwen3_moe``;
megatron-core not installed). Nothing here imports Ray or SGLang.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path

from miles_disagg.bench.http_engine import HttpEngine, engine_throughput

MOE_GPU = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=3072, num_attention_heads=16,
               num_key_value_heads=8, head_dim=64, vocab_size=32000, num_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=512)
MOE_CPU = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def section_moe(shapes, work: Path) -> dict:
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    if "num_experts" not in inspect.signature(make_tiny_qwen3).parameters:
        return {"skipped": "this tree has no qwen3_moe model family (make_tiny_qwen3 takes no num_experts)"}
    shape = MOE_GPU if shapes.device == "cuda" else MOE_CPU
    model_dir = work / "model-moe"
    start = time.perf_counter()
    if not (model_dir / "config.json").is_file():
        make_tiny_qwen3(model_dir, dtype=shapes.engine_dtype, **shape)
    report = {"experts": shape["num_experts"], "top_k": shape["num_experts_per_tok"],
              "model_made_s": round(time.perf_counter() - start, 1)}
    engine, groups = _serve(model_dir, work, shapes, shape)
    report["engine"] = engine
    report["megatron"] = _megatron_step(model_dir, groups)
    return report


def _serve(model_dir: Path, work: Path, shapes, shape: dict) -> tuple[dict, list]:
    """The built-in engine on the MoE: throughput, then samples whose routing is checked."""
    from miles_disagg.engines.launch import launch_engine

    launched = launch_engine(model_dir, log_path=work / "engine-moe.log", startup_timeout_s=180,
                             extra_args=["--device", shapes.device, "--dtype", shapes.engine_dtype,
                                         "--enable-return-routed-experts", "--weight-store-dir", str(work / "store"),
                                         "--local-checkpoint-dir", str(work / "local-moe" / "ckpt")])
    engine = HttpEngine(launched)
    try:
        prompts = [[(7 * i + j) % 90 + 3 for j in range(16)] for i in range(shapes.concurrency)]
        c1 = engine_throughput(engine, prompts[:2], shapes.max_new_tokens, 1)
        cn = engine_throughput(engine, prompts, shapes.max_new_tokens, shapes.concurrency)
        answers = engine.generate({"input_ids": [prompts[0]] * 8, "return_logprob": True,
                                   "return_routed_experts": True, "sampling_params": {
                                       "max_new_tokens": shapes.max_new_tokens, "temperature": 1.0,
                                       "ignore_eos": True}})
    finally:
        engine.stop()
    groups, routing = _samples_with_routing(prompts[0], answers, shape)
    return {"tokens_per_s_c1": round(c1, 1), f"tokens_per_s_c{shapes.concurrency}": round(cn, 1), **routing}, groups


def _samples_with_routing(prompt: list[int], answers: list[dict], shape: dict) -> tuple[list, dict]:
    """One group of the engine's samples, each carrying its decoded routing; what the routing showed."""
    import numpy as np

    from miles_disagg.rollout.routed_experts import RoutingShape, append_call_routing
    from miles_disagg.samples import Group, Sample

    routing = RoutingShape(shape["num_hidden_layers"], shape["num_experts_per_tok"])
    samples = []
    for i, answer in enumerate(answers):
        sample = Sample(prompt_ids=list(prompt), response_ids=answer["output_ids"], reward=float(i % 2),
                        response_logprobs=[float(t[0]) for t in answer["meta_info"]["output_token_logprobs"]])
        append_call_routing(sample, answer["meta_info"], start_len=0, shape=routing,
                            seqlen=len(prompt) + len(sample.response_ids))
        samples.append(sample)
    routed = np.stack([s.rollout_routed_experts for s in samples])
    sparse = routed[..., 0].min(axis=(0, 1)) >= 0  # per layer: holds experts (no -1 anywhere)
    in_range = bool(((routed[:, :, sparse] >= 0) & (routed[:, :, sparse] < shape["num_experts"])).all())
    distinct = bool(all(len(set(row)) == len(row) for row in routed[:, :, sparse].reshape(-1, routing.top_k).tolist()))
    return [Group(prompt_index=0, samples=samples)], {
        "routed_rows_per_sample": int(routed.shape[1]), "sparse_layers": int(sparse.sum()),
        "experts_in_range": in_range, "top_k_distinct": distinct,
        "experts_used": int(len(np.unique(routed[:, :, sparse])))}


def _megatron_step(model_dir: Path, groups: list) -> dict:
    """One megatron step with rollout routing replay on the engine's samples."""
    import importlib.util

    if importlib.util.find_spec("megatron.core") is None:
        return {"skipped": "megatron-core is not installed (carry its wheel to run this part)"}
    from miles_disagg.trainer.megatron.convert import SUPPORTED_MODEL_TYPES

    if "qwen3_moe" not in SUPPORTED_MODEL_TYPES:
        return {"skipped": f"this tree's megatron backend builds {SUPPORTED_MODEL_TYPES}, not qwen3_moe"}
    from miles_disagg.config.training import TrainConfig
    from miles_disagg.distributed import init_distributed
    from miles_disagg.net.process import free_port
    from miles_disagg.trainer.backends import make_backend
    from miles_disagg.trainer.sequence_advantages import assign_advantages

    config = TrainConfig(train_backend="megatron", lr=1e-6, micro_batch_size=4, global_batch_size=8, seed=1,
                         use_rollout_routing_replay=True)
    start = time.perf_counter()
    init_distributed(0, 1, "127.0.0.1", free_port("127.0.0.1"))
    backend = make_backend(config, str(model_dir), rank=0, world_size=1)
    built = time.perf_counter()
    result = backend.train([assign_advantages(groups, config)])
    step = {**result.rollout, **result.steps[0]}
    return {"build_s": round(built - start, 1), "step_s": round(time.perf_counter() - built, 2),
            "loss": step.get("train/loss"), "grad_norm": step.get("train/grad_norm"),
            "routing_replay_match": step.get("train/routing_replay_match"),
            "routing_agreement": step.get("train/routing_agreement"),
            "train_vs_engine_logprob_abs_diff": result.rollout.get("train/train_rollout_logprob_abs_diff")}
