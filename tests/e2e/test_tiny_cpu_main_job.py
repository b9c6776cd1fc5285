"""The main job of the README (``train_async.py --config configs/tiny_cpu.yaml``), run whole.

Until the trainer lands, the job prepares everything (run directory, resolved config,
a loadable random tiny Qwen3 as version 0) and then stops with exit code 3 and a
"not yet implemented: <what>" message.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_main_job_prepares_the_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--output-dir", str(out), "--hf-checkpoint", str(out / "base-model")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr
    assert "not yet implemented: the train_async training loop" in result.stderr
    assert "Traceback" not in result.stderr
    resolved = json.loads((out / "config.json").read_text())
    assert resolved["weights"]["update_weight_transfer_mode"] == "disk-delta"

    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(out / "base-model").model_type == "qwen3"
    assert AutoTokenizer.from_pretrained(out / "base-model")("12").input_ids
