"""Flags appended to the shipped scripts override the scripts' own, ``--sglang-*`` ones included (issue 34):
the last value of a flag wins, as the scripts say, as for every other flag and as in miles; an option
given under another of its SGLang names (``--sglang-expert-parallel-size`` after the script's
``--sglang-ep-size``) replaces it too. Through the scripts themselves, with ``--print-config`` (nothing
starts): no GPU, no model weights."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml
from deadlines import scaled

from test_miles_moe_launch_line import config_only_checkpoint

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def print_config(script: str, env: dict[str, str], *appended: str, cwd: Path) -> dict:
    result = subprocess.run(["bash", str(REPO / "scripts" / script), *appended, "--print-config"], capture_output=True,
                            text=True, timeout=scaled(180), env={**os.environ, "PYTHON": os.sys.executable, **env},
                            cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return yaml.safe_load(result.stdout)


def test_the_4b_script_takes_an_appended_sglang_flag_and_any_other(tmp_path: Path) -> None:
    hf = tmp_path / "qwen3-4b"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    prompts = tmp_path / "dapo.jsonl"
    prompts.write_text(json.dumps({"prompt": [{"role": "user", "content": "1+1?"}], "label": "2"}) + "\n")
    env = {"MILES_DISAGG_QWEN3_4B_DIR": str(hf), "MILES_DISAGG_DAPO_MATH_JSONL": str(prompts),
           "MILES_DISAGG_QWEN3_4B_WORK_DIR": str(tmp_path / "work")}
    config = print_config("run_qwen3_4B_disk_delta.sh", env, "--sglang-mem-fraction-static", "0.6",
                          "--rollout-batch-size", "8", cwd=tmp_path)
    assert config["sglang_args"] == {"mem-fraction-static": "0.6"}  # the script's 0.8, replaced
    assert config["rollout"]["rollout_batch_size"] == 8  # the script's 4, replaced the same way


def test_the_30b_script_takes_appended_sglang_flags_and_aliases(tmp_path: Path) -> None:
    hf = config_only_checkpoint(tmp_path)
    env = {"MILES_DISAGG_QWEN3_30B_A3B_DIR": str(hf), "MILES_DISAGG_DAPO_MATH_JSONL": str(tmp_path / "prompts.jsonl"),
           "MILES_DISAGG_QWEN3_30B_A3B_WORK_DIR": str(tmp_path / "work")}
    config = print_config("run_qwen3_30B_A3B_disk_delta.sh", env, "--sglang-mem-fraction-static", "0.5",
                          "--sglang-expert-parallel-size", "4", cwd=tmp_path)
    assert config["sglang_args"] == {"enable-dp-attention": True, "dp-size": "8", "mem-fraction-static": "0.5",
                                     "expert-parallel-size": "4"}
    assert not (tmp_path / "work").exists()
