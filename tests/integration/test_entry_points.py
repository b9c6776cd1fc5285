"""train.py / train_async.py driven as a user does: subprocesses, exit codes, stderr."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

REPO = Path(__file__).resolve().parents[2]

FLAGS = [
    "--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus", "--rollout-num-gpus-per-engine",
    "--colocate", "--rollout-external", "--rollout-external-engine-addrs", "--rollout-service-url",
    "--update-weight-transfer-mode", "--update-weight-disk-dir", "--update-weight-local-checkpoint-dir",
    "--update-weight-delta-encoding", "--update-weight-delta-checksum", "--custom-update-weight-post-write-path",
    "--sglang-custom-pull-weights-pre-read-hook", "--max-weight-staleness", "--pause-generation-mode",
    "--hf-checkpoint", "--update-weights-interval", "--num-rollout", "--rollout-batch-size",
    "--n-samples-per-prompt", "--global-batch-size", "--config", "--print-config",
]


def run(script: str, *args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, capture_output=True,
                          text=True, timeout=scaled(120))


def test_help_lists_every_flag() -> None:
    result = run("train_async.py", "--help")
    assert result.returncode == 0, result.stderr
    for flag_name in FLAGS:
        assert flag_name in result.stdout, flag_name


DD = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/tmp/u",
      "--update-weight-local-checkpoint-dir", "/tmp/l"]


@pytest.mark.parametrize("script, args, named", [
    ("train.py", DD + ["--hf-checkpoint", "{tmp}", "--colocate"], ["--colocate", "--update-weight-transfer-mode"]),
    ("train_async.py", DD + ["--hf-checkpoint", "{tmp}", "--lora-rank", "4"], ["--lora-rank"]),
    ("train_async.py", DD + ["--hf-checkpoint", "{tmp}", "--prefill-num-servers", "2"], ["--prefill-num-servers"]),
    ("train_async.py", DD + ["--hf-checkpoint", "{tmp}", "--rollout-batch-size", "4"], ["--num-rollout"]),
    ("train_async.py", DD + ["--hf-checkpoint", "{tmp}", "--num-rollout", "2", "--rollout-batch-size", "3",
                             "--actor-num-gpus-per-node", "2"], ["--global-batch-size", "--actor-num-gpus-per-node"]),
    ("train.py", ["--debug-train-only"], ["--load-debug-rollout-data"]),
    ("train.py", ["--save-debug-rollout-data", "/tmp/x.jsonl"], ["--save-debug-rollout-data", "{rollout_id}"]),
    ("train_async.py", DD + ["--hf-checkpoint", "Qwen/Qwen3-4B"], ["--hf-checkpoint"]),
    ("train_async.py", ["--rollout-external"], ["--rollout-external-engine-addrs"]),
    ("train_async.py", ["--rollout-external", "--rollout-external-engine-addrs", "nohost"], ["--rollout-external-engine-addrs"]),
    ("train_async.py", ["--colocate"], ["--colocate"]),
    ("train_async.py", ["--update-weight-delta-encoding", "rle"], ["--update-weight-delta-encoding"]),
    ("train_async.py", ["--pause-generation-mode", "sleep"], ["--pause-generation-mode"]),
])
def test_rejections_exit_2_naming_the_flags(tmp_path: Path, script: str, args: list[str], named: list[str]) -> None:
    result = run(script, *[a.replace("{tmp}", str(tmp_path)) for a in args])
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout
    for flag_name in named:
        assert flag_name in result.stderr, (flag_name, result.stderr)


def test_print_config_merges_yaml_and_command_line_wins() -> None:
    result = run("train_async.py", "--config", "configs/tiny_cpu.yaml", "--print-config")
    assert result.returncode == 0, result.stderr
    assert "rollout_batch_size: 32" in result.stdout
    assert "update_weight_transfer_mode: disk-delta" in result.stdout
    override = run("train_async.py", "--config", "configs/tiny_cpu.yaml", "--print-config",
                   "--rollout-batch-size", "16", "--update-weight-delta-encoding", "overwrite")
    assert override.returncode == 0, override.stderr
    assert "rollout_batch_size: 16" in override.stdout
    assert "update_weight_delta_encoding: overwrite" in override.stdout
    assert "rollout_batch_size: 32" not in override.stdout


def test_cli_help_is_fast_and_lists_subcommands() -> None:
    result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "--help"], capture_output=True,
                            text=True, timeout=scaled(60))
    assert result.returncode == 0
    for name in ("weights", "engine", "router", "agent", "make-tiny-checkpoint", "bench"):
        assert name in result.stdout


def test_load_of_another_backends_save_exits_2_naming_both(tmp_path: Path) -> None:
    """A save's state/ is read only by the --train-backend that wrote it: one line, nothing started."""
    from miles_disagg.trainer.checkpoint import STATE_FORMATS, SaveMeta, write_save

    write_save(tmp_path / "saves", SaveMeta(step=2, version=2, run_id="r", world_size=2, data_position=64,
                                            state_format=STATE_FORMATS["megatron"]),
               lambda partial: (partial / "state").mkdir())
    result = run("train_async.py", "--config", "configs/tiny_cpu.yaml", "--hf-checkpoint", str(tmp_path / "base"),
                 "--hf-checkpoint-init", "tiny-qwen3-digits", "--run-dir", str(tmp_path / "run"), "--load", str(tmp_path / "saves"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert "written by --train-backend megatron; this job has --train-backend fsdp" in result.stderr
    assert "engines:" not in result.stderr and "resuming from" not in result.stderr


def test_bench_http_prints_both_clients_side_by_side() -> None:
    """``miles-disagg bench http``: one JSON object, the same requests through httpx and pooled_http."""
    import json

    result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "bench", "http", "--requests", "200",
                             "--concurrency", "16", "--delay-ms", "1"], capture_output=True, text=True, timeout=scaled(180))
    assert result.returncode == 0, result.stderr[-3000:]
    answer = json.loads(result.stdout)
    for kind in ("httpx", "pooled_http"):
        assert answer[kind]["requests_per_s"] > 0 and answer[kind]["client_cpu_ms_per_request"] > 0
    assert answer["config"] == {"concurrency": 16, "requests": 200, "delay_ms": 1.0}
    assert answer["cpu_per_request_ratio_httpx_over_pooled"] > 0
    refused = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "bench", "http", "--requests", "0"],
                             capture_output=True, text=True, timeout=scaled(60))
    assert refused.returncode == 2 and "--requests must be at least 1" in refused.stderr
