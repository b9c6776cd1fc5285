"""FP8 rollout fed by a full-precision trainer, as miles runs it: a tiny BF16 Qwen3-MoE (the router gate
kept in BF16) and a tiny BF16 dense Qwen3, each converted with ``miles-disagg convert-fp8``;
``train_async.py`` with the FP8 ``--hf-checkpoint`` (what the engines serve) and
``--train-hf-checkpoint`` (the BF16 weights the trainer starts from), ``--use-tis``, and
``--check-weight-update-equal`` (after every update each engine's bytes equal the published state).
The MoE run trains as Qwen3-MoE RL does: GSPO (``--advantage-estimator gspo``: the sequence-level
ratio, steadier than token ratios under changing expert routing) with the engines' routing replayed
(``--use-rollout-routing-replay``); it is the FSDP MoE learning run (Megatron's:
``test_tiny_moe_megatron_ep.py``; the step-0 logprob parity of full-precision engines and the FSDP
trainer on MoE: ``tests/integration/test_fsdp_moe_replay.py``).

Two whole runs, one per model, carry every check: the policy learns count-up; the MoE run's first
step is on-policy and every token is routed as the engine routed it, and its versions name the
experts as the checkpoint does on disk; every version verifies; the newest version applied by a
host equals ``convert-fp8`` of the trainer's final BF16 weights byte for byte; the mismatch metrics
(step-0 train-vs-rollout logprob difference, TIS weights) and the update's density and wire are
recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from run_flags import ONE_ENGINE
from deadlines import scaled

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
STEPS = {"moe": 16, "dense": 12}
"""Steps per run: the dense policy climbs faster (0.04 -> 0.27 over its first 12 steps)."""
BLOCK = ["32", "32"]


def cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", *argv], capture_output=True, text=True,
                          timeout=scaled(timeout))


MODELS = {"moe": ["--num-experts", "4", "--num-experts-per-tok", "2"], "dense": []}
"""The tiny checkpoints (``make-tiny-checkpoint`` flags beyond the digits BF16 base)."""
TRAINED_AS = {"moe": ["--advantage-estimator", "gspo", "--use-rollout-routing-replay"], "dense": []}


def fp8_job(tmp: Path, kind: str) -> tuple[Path, Path, Path]:
    """(the job's directory, its FP8 checkpoint, its run directory) of a whole run on ``kind``'s model."""
    bf16, fp8, run_dir = tmp / "bf16", tmp / "fp8", tmp / "run"
    made = cli("make-tiny-checkpoint", "--out", str(bf16), "--charset", "digits", "--dtype", "bfloat16", "--seed", "1234",
               *MODELS[kind])
    assert made.returncode == 0, made.stderr
    converted = cli("convert-fp8", "--model-dir", str(bf16), "--save-dir", str(fp8), "--block-size", *BLOCK)
    assert converted.returncode == 0, converted.stderr
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--run-dir", str(run_dir), "--hf-checkpoint", str(fp8), "--hf-checkpoint-init", "none",
         "--train-hf-checkpoint", str(bf16), "--use-tis", "--check-weight-update-equal", *TRAINED_AS[kind],
         "--num-rollout", str(STEPS[kind]), "--save", str(run_dir / "saves"), "--save-interval", str(STEPS[kind]),
         *ONE_ENGINE],
        cwd=tmp, capture_output=True, text=True, timeout=scaled(300), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    assert "FP8 rollout: engines serve" in result.stderr
    assert json.loads((bf16 / "config.json").read_text())["model_type"] == {"moe": "qwen3_moe", "dense": "qwen3"}[kind]
    return tmp, fp8, run_dir


@pytest.fixture(scope="module")
def fp8_runs(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """Both whole runs (one module fixture: one worker runs them, one after the other)."""
    return {kind: fp8_job(tmp_path_factory.mktemp(f"fp8_{kind}"), kind) for kind in MODELS}


BOTH = pytest.mark.parametrize("kind", list(MODELS))


@BOTH
def test_the_policy_learns_with_fp8_engines(fp8_runs, kind: str) -> None:
    _, _, run_dir = fp8_runs[kind]
    rewards = [r["rollout/raw_reward"] for r in read_metrics(run_dir / "metrics.jsonl")]
    assert len(rewards) == STEPS[kind]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.1, rewards


def test_the_first_step_is_on_policy_and_every_token_is_routed_as_the_engine_routed_it(fp8_runs) -> None:
    _, _, run_dir = fp8_runs["moe"]
    records = read_metrics(run_dir / "metrics.jsonl")
    assert records[0]["train/ppo_kl_first_step"] == 0.0  # GSPO's sequence ratio is exactly 1 on-policy
    assert all(r["train/routing_replay_match"] == 1.0 for r in records)


def test_versions_are_published_in_the_on_disk_expert_names(fp8_runs) -> None:
    _, _, run_dir = fp8_runs["moe"]
    indexes = sorted(run_dir.rglob("weight_v*/model.safetensors.index.json"))
    assert indexes
    for index in indexes:
        names = set(json.loads(index.read_text())["weight_map"])
        assert any(".mlp.experts." in n and n.endswith(".down_proj.weight") for n in names), index
        assert not any("gate_up_proj" in n for n in names)


@BOTH
def test_the_mismatch_and_the_update_cost_are_recorded(fp8_runs, kind: str) -> None:
    _, _, run_dir = fp8_runs[kind]
    records = read_metrics(run_dir / "metrics.jsonl")
    first = records[0]
    assert 0 < first["train/train_rollout_logprob_abs_diff"] < 1.0  # FP8 engines: a slightly different policy
    assert 0 < first["train/tis_weight_mean"] <= 2.0
    assert all(0 < r["perf/update_weights_density"] <= 1 and r["perf/update_weights_wire_bytes"] > 0 for r in records)
    updates = read_metrics(run_dir / "updates.jsonl")
    assert len(updates) == STEPS[kind] and all(u["ci/weights_equal_engines"] for u in updates)


@BOTH
def test_every_fp8_version_verifies_and_equals_convert_fp8_of_the_trainers_weights(fp8_runs, kind: str) -> None:
    tmp, fp8, run_dir = fp8_runs[kind]
    store = next(p.parent for p in run_dir.rglob("LATEST"))
    latest = json.loads((store / "LATEST").read_text())["version"]
    assert latest == STEPS[kind]
    verified = cli("weights", "verify", "--store", str(store), "--base-dir", str(fp8))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    local = tmp / "host"
    applied = cli("weights", "apply", "--store", str(store), "--base-dir", str(fp8), "--local-dir", str(local))
    assert applied.returncode == 0, applied.stderr
    trained_bf16 = next(run_dir.glob("saves/iter_*/hf"))
    expected = tmp / "expected-fp8"
    converted = cli("convert-fp8", "--model-dir", str(trained_bf16), "--save-dir", str(expected), "--block-size", *BLOCK)
    assert converted.returncode == 0, converted.stderr
    assert tensor_bytes(local) == tensor_bytes(expected)


def tensor_bytes(directory: Path) -> dict[str, bytes]:
    import torch
    from safetensors.torch import load_file

    tensors = {}
    for path in directory.glob("*.safetensors"):
        tensors.update(load_file(path))
    return {n: t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}
