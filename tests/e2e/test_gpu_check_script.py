"""``scripts/gpu_check.sh --cpu``: the prepared GPU check keeps working (small shapes on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(*args: str, env: dict | None = None, timeout: int = 480) -> tuple[subprocess.CompletedProcess, dict]:
    done = subprocess.run([str(SCRIPT), "--cpu", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})
    return done, json.loads(done.stdout)


@pytest.mark.timeout(600)
def test_every_section_runs_on_the_cpu(tmp_path):
    done, report = gpu_check("--work-dir", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    import torch

    assert (report["device"], report["torch"], report["cuda"]) == ("cpu", torch.__version__, torch.version.cuda)
    sections = report["sections"]
    assert list(sections) == ["engine", "fsdp", "megatron", "delta", "moe"]
    assert all(s["ok"] for s in sections.values()), sections
    assert sections["engine"]["staged_activation"] == "staged" and sections["engine"]["tokens_per_s_c1"] > 0
    assert sections["fsdp"]["train_vs_engine_logprob_abs_diff"] < 1e-3  # same weights, float32 on both sides
    assert sections["delta"]["round_trip_exact"] is True
    moe = sections["moe"]  # the MoE model family and Megatron MoE come from the MoE branches
    if "skipped" in moe:
        assert "qwen3_moe" in moe["skipped"]
    else:
        engine = moe["engine"]
        assert engine["experts_in_range"] and engine["top_k_distinct"] and engine["sparse_layers"] >= 1
        assert engine["routed_rows_per_sample"] == 16 + 8 - 1  # prompt 16, 8 new tokens, less the last
        assert "skipped" in moe["megatron"] or moe["megatron"]["routing_replay_match"] == 1.0
    assert "engine: ok" in done.stderr  # progress goes to stderr, the JSON alone to stdout


@pytest.mark.timeout(120)
def test_a_section_over_its_time_box_is_reported_and_the_run_fails(tmp_path):
    done, report = gpu_check("--only", "delta", "--work-dir", str(tmp_path),
                             env={"MILES_DISAGG_GPU_CHECK_TIME_BOX_S": "1"})
    assert done.returncode == 1
    delta = report["sections"]["delta"]
    assert delta["ok"] is False and delta["error"] == "time box of 1s exceeded"


def test_an_unknown_section_is_refused_in_one_line():
    done = subprocess.run([str(SCRIPT), "--cpu", "--only", "nope"], capture_output=True, text=True, timeout=scaled(120),
                          env={**os.environ, "PYTHON": sys.executable})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith("gpu_check: unknown section(s) ['nope']")
