"""Every ``miles-disagg bench`` subcommand runs as the README documents it (``--json``), at tiny
sizes: exit 0 and exactly one JSON object on stdout with the fields the README's table quotes.

Smoke tests, not measurements: nothing here asserts a time or a ratio's size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deadlines import scaled

from miles_disagg.bench.cli import BENCHMARKS

REPO = Path(__file__).resolve().parents[2]

TINY: dict[str, list[str]] = {
    "delta": ["--size-mb", "1", "--repeat", "1", "--workers", "1"],
    "engine": ["--hidden-size", "64", "--num-layers", "1", "--max-new-tokens", "4", "--prompt-tokens", "4",
               "--concurrency", "2", "--rounds", "1"],
    # one version alone, then a burst of one: both publication paths
    "service": ["--replicas", "1", "--versions", "1", "--burst", "1", "--concurrency", "1", "--max-new-tokens", "4",
                "--num-layers", "1", "--poll-interval", "0.2"],
    # the tiny model is built in; a 2 MiB limit: 3 MiB bodies over it, 1 MiB ones under it
    "hostile": ["--max-request-mb", "2", "--body-mb", "3"],
    "colocate": ["--hidden-size", "64", "--num-layers", "1"],
    "http": ["--requests", "40", "--concurrency", "8", "--delay-ms", "1"],
    # one warm-up step and one measured; one optimizer step of 4 samples each
    "async": ["--steps", "2", "--warmup-steps", "1", "--hidden-size", "64", "--num-layers", "1", "--response-len", "4",
              "--", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "4",
              "--micro-batch-size", "4"],
    "publish": ["--ranks", "1,2", "--size-mb", "1"],
    # two engines, four sessions of two turns, one activation: both modes, every figure
    "agentic": ["--engines", "2", "--sessions", "4", "--turns", "2", "--appended-tokens", "20", "--hidden-size", "64",
                "--num-layers", "1", "--activations", "1", "--concurrency", "2", "--tool-ms", "10"],
    "lora": ["--hidden-size", "64", "--num-layers", "1", "--steps", "2", "--requests", "4", "--max-new-tokens", "8"],
    # moto on loopback, one host per region, a short WAN round trip
    "store": ["--size-mb", "4", "--engines-per-region", "1", "--memory-sizes-mb", "2,8", "--wan-rtt-ms", "5"],
}
"""Per benchmark, the flags that make it tiny (after ``--json``)."""

RUN_ELSEWHERE: dict[str, str] = {
    "scale": "tests/integration/test_simulated_engines.py",
}
"""Benchmarks whose ``--json`` run another test makes at tiny sizes and checks field by field (a
superset of this smoke's checks): the suite runs each benchmark once."""

EXPECTED_KEYS: dict[str, set[str]] = {
    "delta": {"wire_ratio", "encode_speedup", "decode_speedup"},
    "engine": {"throughput_ratio"},
    "service": set(),
    "hostile": {"cases", "max_request_bytes"},
    "colocate": set(),
    "http": {"httpx", "pooled_http"},
    "async": {"samples_per_s_sync", "samples_per_s_async", "ratio", "engine_busy_fraction"},
    "publish": {"results", "wire_equal_within_1pct", "model_bytes"},
    "agentic": {"prefix_cache_hit_ratio_vs_ideal", "token_drift", "kv_reuse_across_versions",
                "sessions_per_s_affinity_vs_none", "prefill_per_turn_vs_appended", "affinity", "none"},
    "lora": {"adapter_bytes_vs_full", "activation_stall_vs_median_gap", "full_activation_stall_vs_median_gap",
             "samples_mixing_versions", "throughput_two_adapters_vs_one", "throughput_one_adapter_vs_base",
             "trainer_step_time_lora_vs_full"},
    "store": {"s3_vs_directory", "wan_bytes_per_region_vs_version", "wan_bytes_per_region_vs_version_without_relay",
              "peak_rss_largest_vs_smallest", "far_region_ready_vs_full_checkpoint_per_engine",
              "far_region_ready_vs_full_checkpoint_one_copy", "far_region_ready_shared_cpus_vs_full_checkpoint_one_copy"},
}


def test_every_benchmark_has_a_smoke_variant() -> None:
    assert set(TINY) == set(EXPECTED_KEYS) and not set(TINY) & set(RUN_ELSEWHERE)
    assert set(TINY) | set(RUN_ELSEWHERE) == set(BENCHMARKS)
    for name, test_file in RUN_ELSEWHERE.items():  # that test runs `miles-disagg bench NAME ... --json`
        text = (REPO / test_file).read_text()
        assert f'"bench", "{name}"' in text and '"--json"' in text, f"{test_file} no longer runs bench {name} --json"


def bench(name: str, tmp_path: Path, timeout: float) -> dict:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "bench", name, "--json", *TINY[name]],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"bench {name} --json exited {result.returncode}:\n{result.stderr[-4000:]}"
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"bench {name}: expected one JSON line on stdout, got {result.stdout[-2000:]!r}"
    answer = json.loads(lines[0])
    assert isinstance(answer, dict) and answer
    missing = EXPECTED_KEYS[name] - answer.keys()
    assert not missing, f"bench {name}: missing {sorted(missing)} in {sorted(answer)}"
    return answer


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["delta", "http", "hostile", "engine", "colocate", "service", "publish", "store",
                                  "agentic", "lora"])
def test_bench_runs_with_json(name: str, tmp_path: Path) -> None:
    bench(name, tmp_path, timeout=scaled(600))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_bench_async_runs_with_json(tmp_path: Path) -> None:
    """The README's ``bench async --json``: both entry points on the bench's own model (the tiny
    config's ``hf_checkpoint_init`` must not judge it: that exited 1 before)."""
    answer = bench("async", tmp_path, timeout=scaled(900))
    assert answer["samples_per_s_sync"] > 0 and answer["samples_per_s_async"] > 0


def test_every_benchmark_refuses_a_bad_flag_with_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from miles_disagg.cli import main  # in this process: the parsers alone, no interpreter start per benchmark

    for name in BENCHMARKS:
        assert main(["bench", name, "--json", "--no-such-flag"]) == 2, (name, capsys.readouterr().err[-2000:])
        assert "Traceback" not in capsys.readouterr().err


def test_bench_delta_fp8_runs_with_json(tmp_path: Path) -> None:
    """``bench delta --fp8 --json`` at a tiny size: every learning rate, dense and MoE, both versions."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "bench", "delta", "--fp8", "--json",
                             "--size-mb", "2", "--repeat", "1", "--workers", "1", "--fp8-learning-rates", "1e-6", "1e-5"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(600))
    assert result.returncode == 0, result.stderr[-4000:]
    answer = json.loads(result.stdout)
    assert [(r["kind"], r["lr"]) for r in answer["rows"]] == [("dense", 1e-6), ("dense", 1e-5), ("moe", 1e-6), ("moe", 1e-5)]
    assert answer["round_trip_exact"] and set(answer["targets_met"]) == {
        "wire_vs_bf16_at_lr_1e-6", "wire_not_above_reference", "wire_vs_reference_under_1pct",
        "speed_per_byte_not_below_bf16"}
    for row in answer["rows"]:
        assert row["fp8_bytes"] < row["bf16_bytes"] and row["fp8"]["ours"]["wire_bytes"] > 0
