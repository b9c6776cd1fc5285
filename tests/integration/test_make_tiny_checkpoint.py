"""``miles-disagg make-tiny-checkpoint`` as a subprocess: a loadable HF checkpoint, refusals exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(300)


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "miles_disagg.cli", "make-tiny-checkpoint", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=scaled(240))


def refused(*args: str, match: str) -> None:
    proc = cli(*args)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr and match in proc.stderr, proc.stderr


def test_writes_a_checkpoint_transformers_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "nested" / "tiny"
    proc = cli("--out", str(out), "--hidden-size", "32", "--num-layers", "3", "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["out"] == str(out.resolve()) and summary["num_hidden_layers"] == 3
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no staging directory left behind

    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.model_type == "qwen3"
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.head_dim) == (32, 3, 8)
    assert model.config.vocab_size == summary["vocab_size"] >= len(tokenizer)
    ids = tokenizer("12+3=", return_tensors="pt").input_ids
    assert tokenizer.decode(ids[0]) == "12+3="
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()


def test_digits_charset_gives_a_small_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    proc = cli("--out", str(tmp_path / "digits"), "--charset", "digits")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "digits")
    assert summary["charset"] == "digits" and summary["vocab_size"] == 24 >= len(tokenizer)
    assert tokenizer.decode(tokenizer("12+3=").input_ids) == "12+3="


def test_non_empty_out_is_refused_without_force_and_replaced_with_it(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    refused("--out", str(out), match="is not empty; pass --force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]  # untouched

    proc = cli("--out", str(out), "--force")
    assert proc.returncode == 0, proc.stderr
    names = {p.name for p in out.iterdir()}
    assert "keep.txt" not in names and {"config.json", "model.safetensors", "tokenizer.json"} <= names


def test_impossible_shapes_and_file_destinations_are_refused(tmp_path):
    refused("--out", str(tmp_path / "a"), "--num-heads", "3", "--num-kv-heads", "2",
            match="--num-heads 3 must be a multiple of --num-kv-heads 2")
    refused("--out", str(tmp_path / "b"), "--vocab", "10", match="--vocab must be at least the tokenizer's")
    (tmp_path / "file").write_text("x")
    refused("--out", str(tmp_path / "file"), "--force", match="is not a directory")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
