"""megatron-core is a base dependency: in a fresh virtualenv, ``pip install .`` (no extras) and a
miles Qwen3-4B line's ``train_async.py --dry-run`` (the megatron backend, miles' default) works.

The fresh environment is made with the uv that ``scripts/setup.sh`` installs into ``.venv`` (pip's
indexes and constraints passed as setup.sh passes them), the CPU torch of ``.venv`` first as
setup.sh does on a machine without a GPU, then the project from a built wheel (not editable, no
extras). The launch runs the installed package, from a directory outside the repository.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

from test_miles_launch_line import QWEN3_4B_CONFIG, QWEN3_4B_MODEL_ARGS, QWEN3_4B_PERF, launch_line

REPO = Path(__file__).resolve().parents[2]
UV = Path(sys.prefix) / "bin" / "uv"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _pip_config_args() -> list[str]:
    """pip's indexes, find-links and constraints as uv arguments (what setup.sh hands uv)."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    flags = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
             "constraint": "--constraints"}
    args = ["--index-strategy", "unsafe-best-match", "-q"]
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        flag = flags.get(key.rsplit(".", 1)[-1])
        for item in value.strip("'\"").split() if flag else ():
            args += [flag, item]
    return args


def _install(venv: Path, *requirements: str) -> None:
    result = subprocess.run([str(UV), "pip", "install", "--python", str(venv / "bin" / "python"),
                             *_pip_config_args(), *requirements], capture_output=True, text=True, timeout=scaled(800),
                            cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]


def test_pip_install_without_extras_runs_a_miles_line_dry_run(tmp_path):
    if not UV.exists():
        pytest.skip(f"{UV} is missing: scripts/setup.sh installs it (uv makes the fresh environment)")
    from importlib.metadata import version

    from miles_disagg.models.tiny_qwen3 import build_tokenizer

    venv = tmp_path / "venv"
    made = subprocess.run([str(UV), "venv", "-q", "--python", sys.executable, str(venv)], capture_output=True,
                          text=True, timeout=scaled(120))
    assert made.returncode == 0, made.stderr
    _install(venv, f"torch=={version('torch').split('+')[0]}")  # setup.sh's CPU torch first
    _install(venv, str(REPO))  # `pip install .`: no extras
    python = str(venv / "bin" / "python")
    probe = subprocess.run([python, "-c", "import megatron.core, miles_disagg; print(miles_disagg.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=scaled(300))
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert str(venv) in probe.stdout and str(REPO) not in probe.stdout  # the installed package, not the tree

    root = tmp_path / "line"
    hf = root / "Qwen3-4B"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    build_tokenizer().save_pretrained(hf)
    (root / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    line = launch_line(root, QWEN3_4B_MODEL_ARGS, hf=hf, gpus={"actor": "4", "rollout": "4", "per_engine": "2"},
                       numbers={}, perf=QWEN3_4B_PERF, extra=["--rm-type", "deepscaler"])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    result = subprocess.run([python, "-c", "import sys; from miles_disagg.launcher import main; "
                             "sys.exit(main('train_async', sys.argv[1:]))", *line, "--dry-run"],
                            capture_output=True, text=True, cwd=root, timeout=scaled(300), env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["train_backend"] == "megatron"
