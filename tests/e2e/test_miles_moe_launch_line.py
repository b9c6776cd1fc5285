"""A miles user's Qwen3-30B-A3B launch line (MoE, expert parallelism on the trainer) runs unchanged.

The line is miles' ``scripts/models/qwen3-30B-A3B.sh`` model arguments (MoE flags included) with
the PERF group of miles' ``scripts/run-qwen3-30B-A3B.sh`` (TP 4 with sequence parallelism, EP 8,
expert TP 1, full recomputation, dynamic batches) and the reference page's disk-delta flags,
completed with the other groups of the 4B line (``test_miles_launch_line.launch_line``), and
SGLang expert-parallel engines (``--sglang-ep-size``, DP attention). Against a config-only
directory holding the real model's ``config.json`` it passes ``--print-config`` and ``--dry-run``;
an architecture flag that disagrees with the config (``--num-experts 64``) exits 2 naming the
flag, its value and the config's. ``scripts/run_qwen3_30B_A3B_disk_delta.sh`` passes
``--dry-run`` here too; its real run needs 16 GPUs (``tests/e2e/megatron/test_qwen3_30B_A3B_disk_delta.py``,
marked ``gpu``, skipped with its reason).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from deadlines import scaled

from test_miles_launch_line import REPO, launch_line, run

QWEN3_30B_A3B_CONFIG = {  # Qwen/Qwen3-30B-A3B's config.json
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}

MOE_LAYER_FREQ = "[" + ", ".join(["1"] * 48) + "]"  # as miles' script prints it (FIRST_K_DENSE_REPLACE=0)

QWEN3_30B_A3B_MODEL_ARGS = [  # miles' scripts/models/qwen3-30B-A3B.sh, MODEL_ARGS_ROTARY_BASE=1000000
    "--disable-bias-linear", "--qk-layernorm", "--group-query-attention", "--num-attention-heads", "32",
    "--num-query-groups", "4", "--kv-channels", "128", "--num-layers", "48", "--hidden-size", "2048",
    "--ffn-hidden-size", "6144", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
    "--norm-epsilon", "1e-6", "--rotary-percent", "1.0", "--swiglu", "--untie-embeddings-and-output-weights",
    "--vocab-size", "151936", "--rotary-base", "1000000",
    "--moe-ffn-hidden-size", "768", "--moe-router-score-function", "softmax", "--moe-token-dispatcher-type",
    "alltoall", "--moe-router-topk", "8", "--moe-layer-freq", MOE_LAYER_FREQ, "--num-experts", "128",
    "--moe-grouped-gemm", "--moe-token-drop-policy", "probs", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    "--moe-aux-loss-coeff", "0",
]

QWEN3_30B_A3B_PERF = [  # miles' scripts/run-qwen3-30B-A3B.sh PERF_ARGS
    "--tensor-model-parallel-size", "4", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
    "--context-parallel-size", "1", "--expert-model-parallel-size", "8", "--expert-tensor-parallel-size", "1",
    "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
    "--use-dynamic-batch-size", "--max-tokens-per-gpu", "20480",
]

SGLANG_EP = ["--sglang-ep-size", "8", "--sglang-enable-dp-attention", "--sglang-dp-size", "8"]


def config_only_checkpoint(root: Path) -> Path:
    from miles_disagg.models.tiny_qwen3 import build_tokenizer

    hf = root / "Qwen3-30B-A3B"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(QWEN3_30B_A3B_CONFIG, indent=2))
    build_tokenizer().save_pretrained(hf)
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    return hf


@pytest.fixture(scope="module")
def qwen3_30b_line(tmp_path_factory) -> tuple[Path, list[str]]:
    root = tmp_path_factory.mktemp("qwen3-30b-a3b")
    hf = config_only_checkpoint(root)
    line = launch_line(root, QWEN3_30B_A3B_MODEL_ARGS, hf=hf, gpus={"actor": "8", "rollout": "8", "per_engine": "8"},
                       numbers={"max-tokens-per-gpu": "20480"}, perf=QWEN3_30B_A3B_PERF,
                       extra=["--apply-chat-template", "--rm-type", "math", *SGLANG_EP])
    return root, line


@pytest.mark.timeout(200)
def test_the_qwen3_30b_a3b_launch_line_passes_print_config(qwen3_30b_line) -> None:
    root, line = qwen3_30b_line
    result = run(*line, "--print-config", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in ("train_backend: megatron", "num_layers: 48", "num_experts: 128", "moe_router_topk: 8",
                     "moe_ffn_hidden_size: 768", "expert_model_parallel_size: 8", "expert_tensor_parallel_size: 1",
                     "moe_token_dispatcher_type: alltoall", "moe_router_dtype: fp32", "moe_grouped_gemm: true",
                     "tensor_model_parallel_size: 4"):
        assert expected in out, expected
    sglang = out.split("sglang_args:")[1]
    assert "ep-size: '8'" in sglang and "enable-dp-attention: true" in sglang


@pytest.mark.timeout(200)
def test_the_qwen3_30b_a3b_launch_line_passes_dry_run(qwen3_30b_line) -> None:
    root, line = qwen3_30b_line
    result = run(*line, "--dry-run", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["train_backend"] == "megatron" and plan["topology"] == "managed"
    assert [r["bundle"] for r in plan["placement"]["trainer"]] == list(range(8))
    assert [[b["bundle"] for b in e["bundles"]] for e in plan["placement"]["engines"]] == [list(range(8, 16))]
    if plan["rollout_backend"]["backend"] == "builtin":  # a CPU machine: what the GPU layout needs is said
        assert any("Transformer Engine" in w for w in plan["warnings"]), plan["warnings"]
    assert not (root / "run").exists(), "--dry-run must start and write nothing"


@pytest.mark.parametrize("extra, named", [
    (["--num-experts", "64"], "--num-experts 64 does not match --hf-checkpoint"),
    (["--moe-router-topk", "4"], "--moe-router-topk 4 does not match --hf-checkpoint"),
    (["--rotary-base", "10000000"], "--rotary-base 10000000"),  # miles' default is Qwen3-30B-A3B-2507's
    (["--expert-model-parallel-size", "3"], "not a multiple of --expert-model-parallel-size 3"),
    (["--expert-tensor-parallel-size", "4"], "--expert-tensor-parallel-size 4 is a miles flag that does not apply"),
])
@pytest.mark.timeout(200)
def test_the_line_with_a_wrong_moe_flag_exits_2_naming_it(qwen3_30b_line, extra, named) -> None:
    root, line = qwen3_30b_line
    result = run(*line, *extra, "--print-config", cwd=root)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in result.stderr and "Traceback" not in result.stderr
    if extra[0] == "--num-experts":
        assert "num_experts 128" in result.stderr  # the config's value


@pytest.mark.timeout(200)
def test_the_30b_script_dry_runs_against_a_config_only_checkpoint(tmp_path: Path) -> None:
    hf = config_only_checkpoint(tmp_path)
    env = {**os.environ, "MILES_DISAGG_QWEN3_30B_A3B_DIR": str(hf),
           "MILES_DISAGG_DAPO_MATH_JSONL": str(tmp_path / "prompts.jsonl"),
           "MILES_DISAGG_QWEN3_30B_A3B_WORK_DIR": str(tmp_path / "work"), "PYTHON": os.sys.executable}
    result = subprocess.run(["bash", str(REPO / "scripts" / "run_qwen3_30B_A3B_disk_delta.sh"), "--dry-run"],
                            capture_output=True, text=True, timeout=scaled(180), env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert [r["bundle"] for r in plan["placement"]["trainer"]] == list(range(8))
    assert len(plan["placement"]["engines"]) == 1 and len(plan["placement"]["engines"][0]["bundles"]) == 8
    assert not (tmp_path / "work").exists()
