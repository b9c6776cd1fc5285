"""A miles user's rollout code runs unchanged through ``train_async.py`` (issue 28), in ONE whole run:

* a search-r1-shaped generate function (``miles_search_r1_hooks.generate``: miles' imports, its own
  POSTs to the router with ``text`` and ``input_ids`` bodies through miles' ``post`` and a plain
  aiohttp client, a masked tool turn, its own sample attribute), called through miles' class-based
  rollout function and class-based eval function (``generate_and_rm_group``);
* miles' async reward returning a dict, read through ``--reward-key score``;
* miles' algorithm line: ``--disable-grpo-std-normalization --eps-clip-c 3 --tis-clip-low 0.1
  --kl-loss-type k3 --use-unbiased-kl --use-tis --use-kl-loss``.

Every direct call is attributed: each consumed sample carries one served-version pair per turn,
within the staleness bound, and the first (on-policy) step's trainer logprobs match the engines'
(the check that finds misattributed tokens or versions).
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
from run_flags import ONE_ENGINE
from base_model import place_base_model

from miles_disagg.tracking import read_metrics

pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS, BATCH, STALENESS = 4, 8, 2
MILES_ALGORITHM_LINE = ["--disable-grpo-std-normalization", "--eps-clip-c", "3", "--tis-clip-low", "0.1",
                        "--kl-loss-type", "k3", "--use-unbiased-kl", "--use-tis", "--use-kl-loss",
                        "--kl-loss-coef", "0.01"]


@pytest.fixture(scope="module")
def miles_code_run(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path) -> Path:
    tmp = tmp_path_factory.mktemp("miles-code")
    place_base_model(digits_base_model, tmp)
    run_dir = tmp / "run"
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}
    hooks = "miles_search_r1_hooks"
    command = [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
               "--rollout-batch-size", str(BATCH), "--global-batch-size", "32", "--num-rollout", str(STEPS),
               "--max-weight-staleness", str(STALENESS), "--task", "count-up-tool",
               "--rollout-max-response-len", "6", "--rollout-concurrency", "64",
               "--custom-generate-function-path", f"{hooks}.generate",
               "--rollout-function-path", f"{hooks}.SearchRollout",
               "--eval-function-path", f"{hooks}.SearchEval", "--eval-interval", "2",
               "--eval-prompt-data", "search", "task:count-up-tool", "--eval-max-prompts", "4",
               "--custom-rm-path", f"{hooks}.reward_func", "--reward-key", "score",
               *MILES_ALGORITHM_LINE,
               "--run-dir", str(run_dir), "--hf-checkpoint", str(tmp / "base-model"),
               "--save-debug-rollout-data", str(run_dir / "consumed" / "{rollout_id}.jsonl"), *ONE_ENGINE]
    result = subprocess.run(command, cwd=tmp, capture_output=True, text=True, timeout=scaled(800), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return run_dir


def consumed(run_dir: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "consumed" / f"{step}.jsonl").read_text().splitlines()]


def test_the_search_r1_shaped_hook_trains_with_its_tool_turn_masked(miles_code_run: Path) -> None:
    records = read_metrics(miles_code_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all(r["rollout/trained_token_ratio"] < 1 for r in records)
    calls = [r["rollout/class_rollout_calls"] for r in records if "rollout/class_rollout_calls" in r]
    assert calls and max(calls) >= STEPS  # the class-based rollout made every batch and reported its metrics
    assert max(r["rollout/staleness_max"] for r in records) <= STALENESS
    two_turns = 0
    for step in range(STEPS):
        groups = consumed(miles_code_run, step)
        assert len(groups) == BATCH
        for group in groups:
            for sample in group["samples"]:
                details, turns = sample["metadata"]["reward_details"], sample["metadata"]["turns"]
                assert sample["reward"] == details["score"] and details["turns"] == turns  # own attribute read
                assert len(sample["call_versions"]) == turns  # every direct POST attributed, one per turn
                assert group["consumed_at_version"] - sample["weight_version_start"] <= STALENESS
                if turns == 2:
                    two_turns += 1
                    assert sample["loss_mask"][2:4] == [0, 0] and sample["response_logprobs"][2:4] == [0.0, 0.0]
    assert two_turns > 0


def test_direct_calls_are_attributed_so_the_on_policy_step_matches(miles_code_run: Path) -> None:
    """The logprob-recompute check: step 0's samples were all served by version 0 (the base model);
    recomputing each one's trained tokens with it finds no misattributed sample."""
    import torch
    from transformers import AutoModelForCausalLM

    first = read_metrics(miles_code_run / "metrics.jsonl")[0]
    assert first["train/train_rollout_logprob_abs_diff"] < 1e-3
    model = AutoModelForCausalLM.from_pretrained(miles_code_run.parent / "base-model", dtype=torch.float32).eval()
    misattributed, checked = 0, 0
    for group in consumed(miles_code_run, 0):
        for sample in group["samples"]:
            assert sample["call_versions"] and all(call == [0, 0] for call in sample["call_versions"])
            prompt, response = sample["prompt_ids"], sample["response_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
            logprobs = torch.log_softmax(logits, dim=-1)  # --rollout-temperature 1.0
            diffs = [abs(float(logprobs[len(prompt) - 1 + i, token]) - sample["response_logprobs"][i])
                     for i, token in enumerate(response) if sample["loss_mask"][i]]
            misattributed += max(diffs) > 1e-3
            checked += 1
    assert checked == BATCH * 8 and misattributed == 0


def test_the_class_based_eval_function_runs(miles_code_run: Path) -> None:
    records = read_metrics(miles_code_run / "metrics.jsonl")
    evals = [r for r in records if "eval/search" in r]
    assert evals, [sorted(r) for r in records]
    assert all(r["eval/search_samples"] > 0 for r in evals)


def test_the_miles_algorithm_line_trains(miles_code_run: Path) -> None:
    records = read_metrics(miles_code_run / "metrics.jsonl")
    for r in records:
        assert "train/kl_loss" in r and "train/tis_weight_mean" in r
        assert all(v == v for k, v in r.items() if k.startswith("train/") and isinstance(v, float))  # no NaN
