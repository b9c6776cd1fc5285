"""LoRA RL through ``train_async.py`` as a user runs it (miles' ``--lora-rank 8 --lora-alpha 16
--target-modules all-linear``), then resumed from its save with ``--lora-train-only``.

The base is the e2e tier's tiny digits model with its output head scaled 8x. A random tiny model's
head (initializer range 0.02) bounds every logit to about +-1.3, and LoRA leaves the head frozen, so
no adapter on the projections could make its next-token distribution sharp; a pretrained base has
no such bound, and the scaled head stands in for one. The learning rate is 1.5e-2, 5x the
full-weight run's 3e-3 (configs/tiny_cpu.yaml): at 3e-2 one run in three rose for three steps and
then fell back below the base.

1. 20 steps learn the counting task (the best five consecutive steps' mean reward at least twice
   that of the first three, the untrained policy's, and 0.06 above it; measured at 1.5e-2: 0.033 ->
   0.40 and 0.063 -> 0.29; the tiny model's reward may fall again after its peak, so the peak is
   what is judged), and save. The built-in engines serve
   the adapter versions the trainer publishes (deltas of the adapter alone) beside their resident
   base: no update pauses, and every consumed sample ran on one version start to end.
2. ``--load`` resumes the adapter with ``--lora-train-only`` for two more steps: the run says it rolls
   out on the frozen base, and its rewards are the base's again, while its adapter goes on from the
   saved one (not a fresh one) and the save holds no base weight.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from base_model import place_base_model
from checkpoint_reading import read_state
from deadlines import scaled
from run_flags import ONE_ENGINE

from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
STEPS = 20
LORA = ("--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear", "--lr", "1.5e-2")


def sharp_base(digits_base_model: Path, tmp: Path) -> Path:
    from safetensors.torch import load_file, save_file

    base = place_base_model(digits_base_model, tmp)
    tensors = load_file(str(base / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 8
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


def train(tmp: Path, run: str, num_rollout: int, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--run-dir", str(tmp / run), "--hf-checkpoint", str(tmp / "base-model"), "--num-rollout", str(num_rollout),
         "--save", str(tmp / "saves"), "--save-interval", str(STEPS), *ONE_ENGINE, *LORA, *extra],
        cwd=tmp, capture_output=True, text=True, timeout=scaled(300), env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path) -> dict:
    tmp = tmp_path_factory.mktemp("lora_run")
    sharp_base(digits_base_model, tmp)
    first = train(tmp, "run", STEPS, "--save-debug-rollout-data", str(tmp / "run" / "consumed" / "{rollout_id}.jsonl"))
    saved = find_latest(tmp / "saves")[0]
    adapter = read_state(saved)["model"]
    resumed = train(tmp, "resumed", STEPS + 2, "--load", str(tmp / "saves"), "--lora-train-only")
    return {"tmp": tmp, "first": first, "resumed": resumed, "adapter": adapter,
            "resumed_adapter": read_state(find_latest(tmp / "saves")[0])["model"]}


def rewards(run_dir: Path) -> list[float]:
    return [r["rollout/raw_reward"] for r in read_metrics(run_dir / "metrics.jsonl")]


def best_window(rewards_by_step: list[float], width: int = 5) -> float:
    """The best mean reward of ``width`` consecutive steps after the first three."""
    return max(sum(rewards_by_step[i:i + width]) / width for i in range(3, len(rewards_by_step) - width + 1))


def test_lora_learns_the_counting_task(lora_runs) -> None:
    assert ("LoRA rank 8, alpha 16 on q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj: the engines serve "
            "adapter versions beside the resident base, activated without a pause") in lora_runs["first"].stderr
    assert "engines: serving LoRA adapter version 0" in lora_runs["first"].stderr  # before step 1, never the bare base
    assert "serving LoRA adapter version 0" not in lora_runs["resumed"].stderr  # --lora-train-only: the base
    learned = rewards(lora_runs["tmp"] / "run")
    assert len(learned) == STEPS
    untrained, best = sum(learned[:3]) / 3, best_window(learned)
    assert best >= 2 * untrained and best >= untrained + 0.06, learned


def test_adapter_versions_activate_without_a_pause_and_no_sample_mixes_them(lora_runs) -> None:
    import json

    from miles_disagg.loop.report import join_updates
    from miles_disagg.weights.stores import open_store

    run = lora_runs["tmp"] / "run"
    records = join_updates(read_metrics(run / "metrics.jsonl"), read_metrics(run / "updates.jsonl"))
    assert all(r["perf/update_weights_pause_time"] == 0 for r in records)  # activation beside: nothing paused
    assert all(r["rollout/mixed_version_ratio"] == 0 for r in records)
    store = open_store(run / "weight-updates")
    assert store.latest().version == STEPS
    names = set(store.read_index(STEPS).weight_map)
    assert names and all(n.startswith("base_model.model.") and ".lora_" in n for n in names)  # the adapter alone
    for step in range(STEPS):
        for line in (run / "consumed" / f"{step}.jsonl").read_text().splitlines():
            for sample in json.loads(line)["samples"]:
                assert sample["weight_version_start"] == sample["weight_version_end"]


def test_the_save_holds_the_adapter_and_load_resumes_it(lora_runs) -> None:
    adapter, resumed = lora_runs["adapter"], lora_runs["resumed_adapter"]
    assert adapter and all(".lora_" in name for name in adapter)  # no base weight saved
    assert set(resumed) == set(adapter)
    b_names = [n for n in adapter if ".lora_B." in n]
    moved = sum(float((resumed[n] - adapter[n]).norm()) for n in b_names)
    size = sum(float(adapter[n].norm()) for n in b_names)
    assert size > 0 and moved < size / 2  # two steps on from the saved adapter (a fresh lora_B is zero)
    steps = [r["step"] for r in read_metrics(lora_runs["tmp"] / "resumed" / "metrics.jsonl")]
    assert steps == [STEPS, STEPS + 1]


def test_train_only_rolls_out_on_the_base_and_says_so(lora_runs) -> None:
    assert "--lora-train-only: the adapter is trained and the engines roll out on the frozen base" \
        in lora_runs["resumed"].stderr
    learned, on_base = rewards(lora_runs["tmp"] / "run"), rewards(lora_runs["tmp"] / "resumed")
    assert max(on_base) < best_window(learned) / 2, (on_base, learned)  # the base's rewards, not the adapter's
