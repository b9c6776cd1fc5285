"""What a newcomer's own prompt file meets before anything starts (issue 34), through the entry point
(``launcher.main``), with ``--dry-run`` and without: every record is checked, not the first 64 (a bad
one anywhere exits 2 naming the file, the line and what is wrong, before Ray), and prompt text the
run's tokenizer cannot encode is measured (most of it refused naming the tokenizer, the share and
what to do; some of it a note)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from deadlines import scaled
from launcher_refusals import refused

from miles_disagg.launcher import main

pytestmark = pytest.mark.timeout(scaled(120))
REPO = Path(__file__).resolve().parents[2]
MODES = ([], ["--dry-run"])
ENGLISH = "What is the sum of two and three?"


def args(tmp_path: Path, base: Path, data: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(base), "--num-rollout", "1", "--rollout-batch-size", "4", "--actor-num-gpus-per-node",
            "1", "--rollout-num-gpus", "1", "--run-dir", str(tmp_path / "run"), "--prompt-data", str(data),
            "--rm-type", "math", *extra]


def write_records(path: Path, records: list, bad: tuple[int, str] | None = None) -> Path:
    """``records`` as JSON lines, with line ``bad[0]`` (1-based) replaced by the raw text ``bad[1]``."""
    lines = [json.dumps(record) for record in records]
    if bad is not None:
        lines[bad[0] - 1] = bad[1]
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("line, expected", [
    ('{"prompt": "1+1", "label": "2"', "not valid JSON"),
    ('{"prompt": "1+1"}', "missing key 'label' (--label-key)"),
    ('{"prompt": [{"role": "user", "content": "1+1"}], "label": "2"}', "key 'prompt' holds chat messages; rendering them needs --apply-chat-template"),
    ('{"prompt": 7, "label": "2"}', "key 'prompt' must hold a string or a chat message list, got int"),
])
def test_a_bad_record_far_down_the_file_is_refused_before_anything_starts(capsys, tmp_path, tiny_qwen3_dir,
                                                                          line, expected) -> None:
    data = write_records(tmp_path / "data.jsonl", [{"prompt": "1+1", "label": "2"}] * 300, bad=(250, line))
    for mode in MODES:
        refused(capsys, args(tmp_path, tiny_qwen3_dir, data, *mode), f"--prompt-data: {data}:250: {expected}")
    assert not (tmp_path / "run").exists()


def test_a_long_good_file_passes_and_eval_data_is_read_whole_too(capsys, tmp_path, tiny_qwen3_dir) -> None:
    data = write_records(tmp_path / "data.jsonl", [{"prompt": "1+1", "label": "2"}] * 500)
    code = main("train_async", args(tmp_path, tiny_qwen3_dir, data, "--dry-run"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "prompt text" in w]
    held = write_records(tmp_path / "held.jsonl", [{"prompt": "2+2", "label": "4"}] * 200, bad=(199, "[1]"))
    refused(capsys, args(tmp_path, tiny_qwen3_dir, data, "--eval-interval", "1", "--eval-prompt-data", "held",
                         str(held), "--dry-run"), f"--eval-prompt-data held: {held}:199: expected a JSON object")


def digits_checkpoint(tmp_path: Path, tiny_qwen3_dir: Path) -> Path:
    """The tiny model with the demo's digits tokenizer (and the record saying it was made so)."""
    from miles_disagg.models.tiny_qwen3 import DIGITS_CHARSET, INIT_RECORD_FILENAME, build_tokenizer

    base = tmp_path / "digits-base"
    shutil.copytree(tiny_qwen3_dir, base)
    build_tokenizer(DIGITS_CHARSET).save_pretrained(base)
    record = json.loads((base / INIT_RECORD_FILENAME).read_text())
    record["spec"]["charset"] = DIGITS_CHARSET
    (base / INIT_RECORD_FILENAME).write_text(json.dumps(record))
    return base


def test_english_prompts_on_the_digits_tokenizer_are_refused(capsys, tmp_path, tiny_qwen3_dir) -> None:
    base = digits_checkpoint(tmp_path, tiny_qwen3_dir)
    data = write_records(tmp_path / "mine.jsonl", [{"prompt": ENGLISH, "label": "5"}] * 3)
    for mode in MODES:
        err = refused(capsys, args(tmp_path, base, data, *mode), "--prompt-data: ", "% of the prompt text",
                      f"the tokenizer of --hf-checkpoint {base} (a tiny-qwen3 of the digits charset",
                      "--hf-checkpoint-init tiny-qwen3 --hf-checkpoint NEW_DIR")
        unknown = sum(ch not in "0123456789+-=:, \n" for ch in ENGLISH)
        assert f"({3 * unknown} of {3 * len(ENGLISH)} characters" in err, err
    assert not (tmp_path / "run").exists()


def test_a_few_unknown_characters_are_a_note_not_a_refusal(capsys, tmp_path, tiny_qwen3_dir) -> None:
    base = digits_checkpoint(tmp_path, tiny_qwen3_dir)
    data = write_records(tmp_path / "mine.jsonl", [{"prompt": "12+34=", "label": "46"}, {"prompt": "1+1?", "label": "2"}])
    code = main("train_async", args(tmp_path, base, data, "--dry-run"))
    out, err = capsys.readouterr()
    assert code == 0, err
    notes = [w for w in json.loads(out)["warnings"] if "of the prompt text" in w]
    assert notes == [f"--prompt-data: 10.0% of the prompt text (1 of 10 characters; most often '?') is not in the "
                     f"vocabulary of the tokenizer of --hf-checkpoint {base} (a tiny-qwen3 of the digits charset: "
                     "characters '0123456789+-=:, \\n'): each such piece becomes the one unknown token"], notes


def test_the_demo_with_own_prompts_is_refused_before_its_model_is_made(capsys, tmp_path, monkeypatch) -> None:
    """``./scripts/demo.sh --prompt-data mine.jsonl``: the digits model is made on the first run; its
    tokenizer is known before it exists."""
    monkeypatch.chdir(tmp_path)
    data = write_records(tmp_path / "mine.jsonl", [{"question": ENGLISH, "answer": "5"}] * 2)
    argv = ["--config", str(REPO / "configs/tiny_cpu.yaml"), "--run-dir", str(tmp_path / "run"),
            "--prompt-data", str(data), "--input-key", "question", "--label-key", "answer", "--rm-type", "math"]
    for mode in MODES:
        refused(capsys, [*argv, *mode], "the tiny-qwen3-digits tokenizer --hf-checkpoint-init makes",
                "% of the prompt text", "--hf-checkpoint-init tiny-qwen3 --hf-checkpoint NEW_DIR")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "run").exists()


def test_a_byte_level_or_full_tokenizer_reads_digits_and_english_alike(capsys, tmp_path, tiny_qwen3_dir) -> None:
    data = write_records(tmp_path / "mine.jsonl", [{"prompt": ENGLISH, "label": "5"}])
    code = main("train_async", args(tmp_path, tiny_qwen3_dir, data, "--dry-run"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert not [w for w in json.loads(out)["warnings"] if "prompt text" in w]


def test_a_large_file_is_announced_while_it_is_read(capsys, tmp_path, tiny_qwen3_dir, monkeypatch) -> None:
    from miles_disagg.loop import preflight_checks

    monkeypatch.setattr(preflight_checks, "ANNOUNCED_MIB", 0)
    data = write_records(tmp_path / "data.jsonl", [{"prompt": "1+1", "label": "2"}] * 10)
    assert main("train_async", args(tmp_path, tiny_qwen3_dir, data, "--dry-run")) == 0
    assert f"checking every record of --prompt-data {data} (0 MiB) before anything starts" in capsys.readouterr().err
