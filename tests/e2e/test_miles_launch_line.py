"""A miles user's Qwen3-4B launch line runs unchanged.

The line is the reference page's disk-delta flags completed with miles' Qwen3-4B model
arguments (``scripts/models/qwen3-4B.sh``) and the CKPT / ROLLOUT / EVAL / PERF / GRPO /
OPTIMIZER / WANDB / SGLANG / MISC groups of miles' ``scripts/run-qwen3-4B.sh``, plus the other
miles flags its users pass. Against a config-only Qwen3-4B directory it passes ``--print-config``
and ``--dry-run``; the same line with a tiny model's architecture and CPU-sized numbers trains
two steps on CPU through ``train_async.py`` (Megatron, the miles default, with TP=2 as in the
line, and two engines), with ``--ci-test`` gates on and a miles-signature post-write hook given
by dotted path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from deadlines import scaled

from miles_disagg.loop.report import join_updates
from miles_disagg.net.process import free_port
from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]

QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560,
    "initializer_range": 0.02, "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}

QWEN3_4B_MODEL_ARGS = [  # miles' scripts/models/qwen3-4B.sh
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]
TINY_MODEL_ARGS = [  # the tiny digits Qwen3 (miles-disagg make-tiny-checkpoint --charset digits)
    "--swiglu", "--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128",
    "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups", "2",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "10000", "--vocab-size", "24", "--kv-channels", "16",
    "--qk-layernorm", "--untie-embeddings-and-output-weights",
]


def launch_line(root: Path, model_args: list[str], *, hf: Path, gpus: dict[str, str], numbers: dict[str, str],
                perf: list[str], extra: list[str] = ()) -> list[str]:
    """miles' argument groups, in miles' order; ``numbers`` holds the CPU-sized substitutes."""
    n = {"num-rollout": "3000", "rollout-batch-size": "32", "n-samples-per-prompt": "8",
         "rollout-max-response-len": "8192", "global-batch-size": "256", "n-samples-per-eval-prompt": "16",
         "eval-max-response-len": "16384", "max-tokens-per-gpu": "9216", **numbers}
    disaggregated = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", gpus["actor"],
                     "--rollout-num-gpus", gpus["rollout"], "--rollout-num-gpus-per-engine", gpus["per_engine"]]
    disk_delta = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", str(root / "updates"),
                  "--update-weight-local-checkpoint-dir", str(root / "local-ckpt")]
    ckpt = ["--hf-checkpoint", str(hf), "--ref-load", str(root / f"{hf.name}_torch_dist"),
            "--load", str(root / "miles-ckpt"),
            "--save", str(root / "miles-ckpt"), "--save-interval", "20"]
    rollout = ["--prompt-data", str(root / "prompts.jsonl"), "--input-key", "prompt", "--label-key", "label",
               "--rollout-shuffle", "--num-rollout", n["num-rollout"], "--rollout-batch-size", n["rollout-batch-size"],
               "--n-samples-per-prompt", n["n-samples-per-prompt"], "--rollout-max-response-len",
               n["rollout-max-response-len"], "--rollout-temperature", "1", "--global-batch-size",
               n["global-batch-size"], "--balance-data"]
    evaluation = ["--eval-interval", "20", "--eval-prompt-data", "aime", str(root / "prompts.jsonl"),
                  "--n-samples-per-eval-prompt", n["n-samples-per-eval-prompt"], "--eval-max-response-len",
                  n["eval-max-response-len"], "--eval-top-p", "1"]
    grpo = ["--advantage-estimator", "grpo", "--use-kl-loss", "--kl-loss-coef", "0.00", "--kl-loss-type",
            "low_var_kl", "--entropy-coef", "0.00", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
    optimizer = ["--optimizer", "adam", "--lr", "1e-6", "--lr-decay-style", "constant", "--weight-decay", "0.1",
                 "--adam-beta1", "0.9", "--adam-beta2", "0.98"]
    wandb = ["--wandb-project", "miles-dev", "--wandb-group", "qwen3-4B-test", "--wandb-key", "0123456789abcdef",
             "--wandb-team", "rl-team", "--wandb-host", "https://wandb.example.com", "--disable-wandb-random-suffix"]
    sglang = ["--sglang-mem-fraction-static", "0.7", "--sglang-server-concurrency", "64",
              "--sglang-router-port", str(free_port("127.0.0.1")), "--use-miles-router"]
    misc = ["--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--accumulate-allreduce-grads-in-fp32",
            "--attention-softmax-in-fp32", "--attention-backend", "flash", "--ci-test", "--fully-async",
            "--num-gpus-per-node", "8", "--use-fault-tolerance", "--rollout-health-check-interval", "30",
            "--rollout-health-check-timeout", "30", "--rollout-health-check-first-wait", "0",
            "--megatron-to-hf-mode", "raw", "--num-steps-per-rollout", "1", "--update-weight-buffer-size",
            str(512 * 1024**2), "--check-weight-update-equal", "--rollout-stop", "</answer>",
            "--run-dir", str(root / "run")]
    return (disaggregated + disk_delta + model_args + ckpt + rollout + evaluation + perf + grpo + optimizer + wandb
            + sglang + misc + list(extra))


QWEN3_4B_PERF = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1",
                 "--context-parallel-size", "1", "--expert-model-parallel-size", "1", "--expert-tensor-parallel-size",
                 "1", "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                 "1", "--use-dynamic-batch-size", "--max-tokens-per-gpu", "9216"]


def run(*args: str, cwd: Path, timeout: int = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "train_async.py"), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=scaled(timeout), env=env)


@pytest.fixture(scope="module")
def qwen3_4b_line(tmp_path_factory) -> tuple[Path, list[str]]:
    """A config-only Qwen3-4B checkpoint (config.json and tokenizer files, no weights) and the line."""
    from miles_disagg.models.tiny_qwen3 import build_tokenizer

    root = tmp_path_factory.mktemp("qwen3-4b")
    hf = root / "Qwen3-4B"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG, indent=2))
    build_tokenizer().save_pretrained(hf)
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    line = launch_line(root, QWEN3_4B_MODEL_ARGS, hf=hf, gpus={"actor": "4", "rollout": "4", "per_engine": "2"},
                       numbers={}, perf=QWEN3_4B_PERF, extra=["--apply-chat-template", "--rm-type", "deepscaler",
                                                              "--use-wandb"])
    return root, line


@pytest.mark.timeout(200)
def test_the_qwen3_4b_launch_line_passes_print_config(qwen3_4b_line) -> None:
    root, line = qwen3_4b_line
    result = run(*line, "--print-config", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in ("train_backend: megatron", "num_layers: 36", "qk_layernorm: true", "ci_test: true",
                     "check_weight_update_equal: true", "fully_async: true", "update_weight_delta_filter: auto",
                     "rollout_concurrency: 128", "wandb_team: rl-team", "wandb_key: <redacted>",
                     "wandb_host: https://wandb.example.com", "disable_wandb_random_suffix: true"):
        assert expected in out, expected
    assert "0123456789abcdef" not in out + result.stderr
    assert "mem-fraction-static: '0.7'" in out and "router-port" not in out.split("sglang_args:")[1]


@pytest.mark.timeout(200)
def test_the_qwen3_4b_launch_line_passes_dry_run(qwen3_4b_line) -> None:
    import importlib.util

    root, line = qwen3_4b_line
    if importlib.util.find_spec("wandb") is None:  # the line asks for wandb: refused before anything starts
        refused = run(*line, "--dry-run", cwd=root)
        assert refused.returncode == 2 and "--use-wandb: wandb is not installed" in refused.stderr, refused.stderr
        line = [arg for arg in line if arg != "--use-wandb"]
    result = run(*line, "--dry-run", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)  # exactly one JSON object on stdout
    assert plan["train_backend"] == "megatron" and plan["topology"] == "managed"
    assert [r["bundle"] for r in plan["placement"]["trainer"]] == [0, 1, 2, 3]
    assert [[b["bundle"] for b in e["bundles"]] for e in plan["placement"]["engines"]] == [[4, 5], [6, 7]]
    roles = [p["role"] for p in plan["processes"]]
    assert roles[0] == "router" and roles.count("engine") + roles.count("sglang") == 2
    router = plan["processes"][0]["argv"]
    assert router[router.index("--port") + 1] == line[line.index("--sglang-router-port") + 1]
    assert plan["delta_filter"]["filter"] in ("byteplane", "none") and plan["delta_filter"]["reason"]
    if plan["rollout_backend"]["backend"] == "builtin":  # a CPU machine: the built-in engine, byte planes
        assert plan["delta_filter"]["filter"] == "byteplane"
        assert any("--sglang-mem-fraction-static" in w for w in plan["warnings"])
    assert not (root / "run").exists(), "--dry-run must start and write nothing"


@pytest.mark.parametrize("extra, named", [
    (["--num-layers", "28"], "--num-layers 28 does not match"),
    (["--keep-old-actor"], "--keep-old-actor is a miles flag that does not apply here"),
    (["--sglang-config", "groups.yaml"], "--sglang-config is a miles flag that does not apply here"),
])
@pytest.mark.timeout(200)
def test_the_line_with_a_refused_flag_or_a_wrong_architecture_exits_2(qwen3_4b_line, extra, named) -> None:
    root, line = qwen3_4b_line
    result = run(*line, *extra, "--print-config", cwd=root)
    assert result.returncode == 2, result.stderr[-2000:]
    assert named in result.stderr and "Traceback" not in result.stderr
    assert "unrecognized arguments" not in result.stderr


MILES_HOOK = '''
import json, os


def record_version(args, version_dir, rollout_engines):
    """miles' post-write signature: (args, version_dir, rollout_engines)."""
    store = args.update_weight_disk_dir
    latest = json.load(open(os.path.join(store, "LATEST")))["version"] if os.path.exists(os.path.join(store, "LATEST")) else 0
    with open(os.environ["MILES_HOOK_RECORD"], "a") as out:
        out.write(json.dumps({"version_dir": version_dir, "latest_at_call": latest,
                              "index_present": os.path.exists(os.path.join(version_dir, "model.safetensors.index.json")),
                              "engines": list(rollout_engines), "ci_test": args.ci_test}) + "\\n")
'''


TORCH_DIST_REF = r'''
import sys, warnings
warnings.simplefilter("ignore")


def main(hf_dir, out):
    """The tiny model with changed weights, saved as miles' --ref-load: a Megatron torch_dist checkpoint."""
    import torch

    from miles_disagg.config.components import TrainConfig
    from miles_disagg.engines.launch import free_port
    from miles_disagg.models.tiny_qwen3 import CHARSETS, make_tiny_qwen3
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.megatron.backend import MegatronBackend
    from miles_disagg.trainer.torch_dist import save_torch_dist

    make_tiny_qwen3(hf_dir, seed=1234, charset=CHARSETS["digits"])
    init_distributed(0, 1, "127.0.0.1", free_port())
    backend = MegatronBackend(TrainConfig(train_backend="megatron"), hf_dir, rank=0, world_size=1)
    with torch.no_grad():
        for p in backend.gpt.parameters():
            p.mul_(1.05)
    save_torch_dist(backend.gpt, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''


@pytest.mark.timeout(400)
def test_the_tiny_variant_of_the_line_trains_two_steps_on_cpu(tmp_path: Path) -> None:
    """As miles passes them, --ref-load is a torch_dist checkpoint and --load a directory without a
    save yet: the policy starts from the --ref-load weights, published as v1 before any rollout.
    The trainer is TP=2 (as the real line) and its disk-delta versions reach two engines."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'miles-disagg[megatron]')")
    (tmp_path / "make_ref.py").write_text(TORCH_DIST_REF)
    made = subprocess.run([sys.executable, str(tmp_path / "make_ref.py"), str(tmp_path / "base"),
                           str(tmp_path / "base_torch_dist")], capture_output=True, text=True, timeout=scaled(200))
    assert made.returncode == 0, made.stderr[-3000:]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "label": "3"}) + "\n"
                                                    for p in ("1 2 3", "5 6", "2 3 4 5", "7 8")))
    (tmp_path / "hooks").mkdir()
    (tmp_path / "hooks" / "miles_user_hooks.py").write_text(MILES_HOOK)
    record = tmp_path / "hook-calls.jsonl"
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled", "MILES_HOOK_RECORD": str(record),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "hooks"), os.environ.get("PYTHONPATH")]))}
    line = launch_line(
        tmp_path, TINY_MODEL_ARGS, hf=tmp_path / "base",
        gpus={"actor": "2", "rollout": "2", "per_engine": "1"},
        numbers={"num-rollout": "2", "rollout-batch-size": "4", "n-samples-per-prompt": "4",
                 "rollout-max-response-len": "3", "global-batch-size": "16", "n-samples-per-eval-prompt": "2",
                 "eval-max-response-len": "3", "max-tokens-per-gpu": "256"},
        perf=[p for p in QWEN3_4B_PERF if p != "--sequence-parallel"],  # sequence parallelism needs CUDA + TE
        extra=["--tensor-model-parallel-size", "2", "--max-tokens-per-gpu", "256", "--rm-type", "count-up",
               "--rollout-backend", "builtin", "--custom-update-weight-post-write-path", "miles_user_hooks.record_version"])
    result = run(*line, cwd=tmp_path, timeout=scaled(280), env=env)
    assert result.returncode == 0, result.stderr[-6000:]

    router_port = line[line.index("--sglang-router-port") + 1]
    assert f"behind the router at http://127.0.0.1:{router_port}" in result.stderr
    assert f"the policy starts from --ref-load {tmp_path / 'base_torch_dist'}" in result.stderr
    assert "published as v1" in result.stderr
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    # the first rollout was generated by the --ref-load policy the trainer holds, not the HF base
    assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-3
    assert records[0]["train/ppo_kl_first_step"] == pytest.approx(0.0, abs=1e-6)
    assert [r["weights/version"] for r in records] == [2, 3]
    # each activation (after its step's record): the --ci-test gates ran and passed, the engine
    # serves exactly what was published
    updates = read_metrics(tmp_path / "run" / "updates.jsonl")
    assert [u["step"] for u in updates] == [0, 1]
    for u in updates:
        assert u["weights/version"] == u["step"] + 2
        assert u["weights/engine_versions"] == [str(u["step"] + 2)] * 2
        assert u["ci/weights_equal_engines"] == 2.0  # engines checked equal to the trainer
    for r in join_updates(records, updates):
        assert 0 < r["perf/update_weights_density"] <= 1 and r["perf/update_weights_wire_bytes"] > 0
    assert "weights: delta filter byteplane (auto: every consumer (2) announces byte planes)" in result.stderr
    assert (tmp_path / "updates" / "weight_v000003").is_dir()  # the newest version was published
    for version in (1, 2, 3):
        index = json.loads((tmp_path / "updates" / f"weight_v{version:06d}" / "model.safetensors.index.json").read_text())
        assert index["metadata"]["filter"] == "byteplane"

    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [Path(c["version_dir"]).name for c in calls] == [f"weight_v00000{v}" for v in (1, 2, 3)]  # once each
    for version, call in enumerate(calls, start=1):
        assert call["latest_at_call"] == version - 1, "the hook must run before the version is visible"
        assert call["index_present"] and call["ci_test"] is True
        assert len(call["engines"]) == 2 and all(url.startswith("http://") for url in call["engines"])
    assert "0123456789abcdef" not in (tmp_path / "run" / "config.json").read_text()
