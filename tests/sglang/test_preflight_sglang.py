"""``--sglang-*`` options judged by SGLang's own ``ServerArgs`` before anything starts (issue 29):
a typo exits 2 with the closest SGLang option, a value SGLang refuses exits 2, a good option passes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.launcher import main


def argv(tmp_path: Path, base: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(base), "--num-rollout", "1", "--rollout-batch-size", "4", "--actor-num-gpus-per-node",
            "1", "--rollout-num-gpus", "1", "--rollout-backend", "sglang", "--run-dir", str(tmp_path / "run"), *extra]


def test_a_typod_sglang_option_is_refused_with_the_closest(sglang_loaded, capsys, tmp_path, tiny_qwen3_dir) -> None:
    for mode in ([], ["--dry-run"]):
        code = main("train_async", argv(tmp_path, tiny_qwen3_dir, "--sglang-mem-fraction-statik", "0.7", *mode))
        out, err = capsys.readouterr()
        assert code == 2 and out == "" and "Traceback" not in err, err
        assert "--sglang-mem-fraction-statik: SGLang has no option --mem-fraction-statik" in err
        assert "did you mean --sglang-mem-fraction-static?" in err
    assert not (tmp_path / "run").exists()


def test_a_value_sglang_refuses(sglang_loaded, capsys, tmp_path, tiny_qwen3_dir) -> None:
    code = main("train_async", argv(tmp_path, tiny_qwen3_dir, "--sglang-mem-fraction-static", "lots", "--dry-run"))
    err = capsys.readouterr().err
    assert code == 2 and "--sglang-mem-fraction-static: SGLang refuses it" in err, err


def test_good_sglang_options_pass(sglang_loaded, capsys, tmp_path, tiny_qwen3_dir) -> None:
    code = main("train_async", argv(tmp_path, tiny_qwen3_dir, "--sglang-mem-fraction-static", "0.7",
                                    "--sglang-enable-memory-saver", "--sglang-log-level=warning", "--dry-run"))
    out, err = capsys.readouterr()
    assert code == 0, err
    sglang = [p for p in json.loads(out)["processes"] if p["role"] == "sglang"]
    assert "--mem-fraction-static" in sglang[0]["argv"]
