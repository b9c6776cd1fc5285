"""Preflight (issue 29): what would fail later inside an actor is refused before anything starts, in
``--dry-run`` and in a real run alike, through the entry point (``launcher.main``): exit 2, one line
naming the flag, no traceback, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from deadlines import scaled
from launcher_refusals import refused

from miles_disagg.launcher import main

pytestmark = pytest.mark.timeout(scaled(120))
REPO = Path(__file__).resolve().parents[2]
MODES = ([], ["--dry-run"])


def args(tmp_path: Path, base: Path, *extra: str) -> list[str]:
    return ["--hf-checkpoint", str(base), "--num-rollout", "1", "--rollout-batch-size", "4", "--actor-num-gpus-per-node",
            "1", "--rollout-num-gpus", "1", "--run-dir", str(tmp_path / "run"), *extra]


def write_jsonl(path: Path, *lines: str) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize("mode", MODES)
def test_missing_prompt_data(capsys, tmp_path, tiny_qwen3_dir, mode) -> None:
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--prompt-data", "/nonexistent.jsonl", *mode),
            "--prompt-data '/nonexistent.jsonl' does not exist")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("lines, expected", [
    (['{"prompt": "1+1", "label": "2"}', "{not json"], ":2: not valid JSON"),
    (['["a list"]'], ":1: expected a JSON object, got list"),
    (['{"question": "1+1", "label": "2"}'], "missing key 'prompt' (--input-key)"),
    (['{"prompt": "1+1"}'], "missing key 'label' (--label-key)"),
    ([], "holds no records"),
])
def test_prompt_data_that_does_not_parse(capsys, tmp_path, tiny_qwen3_dir, lines, expected) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", *lines)
    for mode in MODES:
        refused(capsys, args(tmp_path, tiny_qwen3_dir, "--prompt-data", str(data), "--rm-type", "math", *mode),
                "--prompt-data", expected)


def test_a_huge_file_without_newlines_is_refused_without_reading_it_whole(capsys, tmp_path, tiny_qwen3_dir,
                                                                          monkeypatch) -> None:
    from miles_disagg.loop import preflight_checks

    monkeypatch.setattr(preflight_checks, "MAX_LINE_BYTES", 1024)
    data = tmp_path / "blob.jsonl"
    data.write_bytes(b"\x00" * 10_000)
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--prompt-data", str(data), "--dry-run"),
            ":1: a line longer than 1024 bytes")


def test_prompt_data_with_the_configured_keys_passes(capsys, tmp_path, tiny_qwen3_dir) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", '{"q": "1+1", "a": "2"}', "", '{"q": "2+2", "a": "4"}')
    code = main("train_async", args(tmp_path, tiny_qwen3_dir, "--prompt-data", str(data), "--input-key", "q",
                                    "--label-key", "a", "--rm-type", "math", "--dry-run"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["topology"] == "managed"


def test_eval_data_is_checked_too(capsys, tmp_path, tiny_qwen3_dir) -> None:
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--eval-interval", "1", "--eval-prompt-data", "held", "/no/eval.jsonl",
                         "--dry-run"), "--eval-prompt-data held '/no/eval.jsonl' does not exist")
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--eval-interval", "1", "--eval-prompt-data", "held", "task:count-dwn"),
            "--eval-prompt-data held 'task:count-dwn': no such built-in task", "count-up")


@pytest.mark.parametrize("mode", MODES)
def test_a_reward_that_does_not_import(capsys, tmp_path, tiny_qwen3_dir, mode) -> None:
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--custom-rm-path", "nosuch.mod:fn", *mode),
            "--custom-rm-path 'nosuch.mod:fn': cannot import module 'nosuch.mod'")
    assert not (tmp_path / "run").exists()


def test_a_reward_with_the_wrong_signature(capsys, tmp_path, tiny_qwen3_dir) -> None:
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--custom-rm-path", "json:dumps", "--dry-run"), "--custom-rm-path")


@pytest.mark.parametrize("flag, module", [("--use-tensorboard", "tensorboard"), ("--use-wandb", "wandb")])
def test_a_tracking_backend_that_is_not_installed(capsys, tmp_path, tiny_qwen3_dir, monkeypatch, flag, module) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    for mode in MODES:
        refused(capsys, args(tmp_path, tiny_qwen3_dir, flag, *mode), f"{flag}: {module} is not installed")


def test_a_machine_with_fewer_gpus_than_asked(capsys, tmp_path, tiny_qwen3_dir, monkeypatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("miles_disagg.loop.ray_start.cuda_device_count", lambda: 2)
    argv = ["--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "64", "--run-dir", str(tmp_path / "run")]
    refused(capsys, argv, "asks for 65 bundles of 1 GPU + 1 CPU (trainer 1: ",
            "rollout 64: --rollout-num-gpus); this machine has 2 GPUs")
    # --dry-run plans for a target machine: what this one lacks is a warning there
    code = main("train_async", [*argv, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert any(w.startswith("on this machine: this run asks for 65 bundles") for w in json.loads(out)["warnings"])


def test_a_machine_without_cuda_has_the_local_rays_cpus(capsys, tmp_path, tiny_qwen3_dir, monkeypatch) -> None:
    """Without CUDA the local Ray has one logical GPU per bundle, but only so many CPUs: 65 bundles
    would wait for a placement that never comes."""
    from miles_disagg.loop.ray_start import local_ray_num_cpus

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr("miles_disagg.loop.ray_start.cuda_device_count", lambda: 0)
    argv = ["--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "64", "--run-dir", str(tmp_path / "run")]
    refused(capsys, argv, "asks for 65 bundles", f"a local Ray here offers {local_ray_num_cpus()} CPUs")


def test_a_typod_hf_checkpoint_is_not_made_by_the_configs_init(capsys, tmp_path) -> None:
    config = ["--config", str(REPO / "configs/tiny_cpu.yaml"), "--run-dir", str(tmp_path / "run"), "--num-rollout", "1"]
    for mode in MODES:
        refused(capsys, [*config, "--hf-checkpoint", str(tmp_path / "typo"), *mode],
                f"--hf-checkpoint '{tmp_path / 'typo'}' is not a local directory", "--hf-checkpoint-init tiny-qwen3-digits")
    assert not (tmp_path / "typo").exists()
    # asked for on the command line, the init makes a model at the given path (the dry run says it will)
    code = main("train_async", [*config, "--hf-checkpoint", str(tmp_path / "new"), "--hf-checkpoint-init",
                                "tiny-qwen3-digits", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert any("the run creates a random tiny-qwen3-digits" in w for w in json.loads(out)["warnings"])


def test_an_existing_other_checkpoint_is_used_as_it_is(tmp_path, tiny_qwen3_dir) -> None:
    from miles_disagg.config import load_config

    config, _ = load_config(["--config", str(REPO / "configs/tiny_cpu.yaml"), "--hf-checkpoint", str(tiny_qwen3_dir)],
                            "train_async")
    assert config.train.hf_checkpoint_init == "none"  # no init record needed: it is the user's model
    config, _ = load_config(["--config", str(REPO / "configs/tiny_cpu.yaml")], "train_async")
    assert config.train.hf_checkpoint_init == "tiny-qwen3-digits"  # the config's own path keeps its init


@pytest.mark.parametrize("mode", MODES)
def test_weight_and_rollout_hooks_that_do_not_import(capsys, tmp_path, tiny_qwen3_dir, mode) -> None:
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--custom-update-weight-post-write-path", "no_such_module_xyz.hook",
                         *mode), "--custom-update-weight-post-write-path")
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--custom-generate-function-path", "no_such_module_xyz.gen", *mode),
            "--custom-generate-function-path")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("mode", MODES)
def test_a_rollout_service_that_does_not_answer(capsys, tmp_path, tiny_qwen3_dir, mode) -> None:
    from miles_disagg.net.process import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    refused(capsys, args(tmp_path, tiny_qwen3_dir, "--rollout-service-url", url, "--update-weight-transfer-mode",
                         "disk-delta", "--update-weight-disk-dir", str(tmp_path / "store"), *mode),
            f"--rollout-service-url: 1 of 1 did not answer: {url}: cannot connect")
