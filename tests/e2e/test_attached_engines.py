"""``train_async.py --rollout-external`` against engines an earlier job left at its version 4:
they are brought to this job's base (version 0) before any request, then follow this job.

The same run carries a user's multi-turn generate function, named by dotted path from a test
file (``--custom-generate-function-path multiturn_hooks.generate``): a multi-turn episode with tool
turns trains; tool tokens carry ``loss_mask`` 0; each sample's start/end versions bracket the
versions of its engine calls. The run's router is two processes on one port (``--router-workers 2``):
every call, wherever it was routed, honoured its version constraint. (Each whole run costs about half
a minute of CPU; the checks need nothing of each other.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from deadlines import scaled
from base_model import place_base_model

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
INTEGRATION = REPO / "tests" / "integration"
STEPS = 3


def bring_to_an_earlier_jobs_v4(tmp: Path, base: Path, engines: list) -> None:
    """Publish four versions to an earlier job's store and activate its version 4 on every engine."""
    sys.path.insert(0, str(INTEGRATION))
    from rollout_fixtures import VersionSource

    from miles_disagg.engines.client import EngineClient

    earlier = VersionSource(tmp / "earlier-job-store", base)
    try:
        for seed in range(4):
            earlier.publish_next(seed=seed)
        for i, engine in enumerate(engines):
            with EngineClient(engine.url, store_dir=tmp / "earlier-job-store",
                              local_checkpoint_dir=tmp / f"engine-local-{i}") as client:
                client.pull(4)
                client.pause("retract")
                client.load(4)
                client.resume()
                assert client.weight_version() == "4"
    finally:
        earlier.close()


@pytest.fixture(scope="module")
def attached_multi_turn_run(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path):
    from miles_disagg.engines.launch import launch_engine

    tmp = tmp_path_factory.mktemp("attached")
    base = place_base_model(digits_base_model, tmp)
    # each engine's roots: the stores it may pull from (the earlier job's and this job's) and its checkpoint
    stores = ["--weight-store-dir", str(tmp / "earlier-job-store"),
              "--weight-store-dir", str(tmp / "run" / "weight-updates")]
    engines = [launch_engine(base, log_path=tmp / f"engine-{i}.log",
                             extra_args=[*stores, "--local-checkpoint-dir", str(tmp / f"engine-local-{i}")])
               for i in range(2)]
    try:
        bring_to_an_earlier_jobs_v4(tmp, base, engines)
        env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
               "RAY_AUTH_MODE": "disabled",
               "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}
        run_dir = tmp / "run"
        # half the groups of the other runs: each sample makes three engine calls, and what is
        # checked is per sample (two optimizer steps per rollout still)
        result = subprocess.run(
            [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
             "--hf-checkpoint", str(base), "--run-dir", str(run_dir), "--num-rollout", str(STEPS),
             "--rollout-batch-size", "4", "--global-batch-size", "16", "--rollout-external",
             "--rollout-external-engine-addrs", *[e.url.removeprefix("http://") for e in engines],
             "--custom-generate-function-path", "multiturn_hooks.generate", "--rollout-max-response-len", "9",
             "--max-weight-staleness", "1", "--router-workers", "2",
             "--save-debug-rollout-data", str(run_dir / "consumed" / "{rollout_id}.jsonl")],
            cwd=tmp, capture_output=True, text=True, timeout=scaled(400), env=env)
        assert result.returncode == 0, result.stderr[-6000:]
        yield run_dir
    finally:
        for engine in engines:
            engine.stop()


def test_engines_of_an_earlier_job_are_brought_to_this_jobs_base_first(attached_multi_turn_run: Path) -> None:
    run_dir = attached_multi_turn_run
    records = read_metrics(run_dir / "metrics.jsonl")
    updates = read_metrics(run_dir / "updates.jsonl")  # each activation, after its step's record
    assert [u["weights/engine_versions"] for u in updates] == [[str(v), str(v)] for v in range(1, STEPS + 1)]
    assert all(r["rollout/served_version_mean"] <= r["step"] for r in records)  # never the earlier job's v4


def test_a_multi_turn_generate_function_from_a_test_file_trains(attached_multi_turn_run: Path) -> None:
    run_dir = attached_multi_turn_run
    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert all("train/loss" in r and r["weights/version"] == r["step"] + 1 for r in records)
    num_tool_tokens = 0
    for step in range(STEPS):
        for line in (run_dir / "consumed" / f"{step}.jsonl").read_text().splitlines():
            group = json.loads(line)
            for sample in group["samples"]:
                num_tool_tokens += check_episode(sample, group["consumed_at_version"])
    assert num_tool_tokens > 0  # episodes did reach their tool turns
    # tool tokens carry a 0.0 logprob placeholder: only if the trainer leaves them out (loss_mask 0: no
    # gradient, no metric) do its logprobs match the engine's on the on-policy first step (the
    # engines serve this job's base, not the earlier job's version 4)
    assert records[0]["train/train_rollout_logprob_abs_diff"] < 1e-3


def test_the_router_ran_as_two_processes(attached_multi_turn_run: Path) -> None:
    router_log = (attached_multi_turn_run / "logs" / "router.log").read_text()
    assert "2 processes" in router_log and "Traceback" not in router_log, router_log[-3000:]


def check_episode(sample: dict, consumed_at: int) -> int:
    """Mask zero exactly on the tool's tokens; start/end bracket every call; each call honoured its
    constraint. Returns the number of tool tokens."""
    calls = sample["call_versions"]
    mask = sample["loss_mask"] or [1] * len(sample["response_ids"])  # None: no tool turn, all trained
    spans = sample["metadata"].get("tool_spans", [])
    assert len(calls) == len(spans) + 1 and len(mask) == len(sample["response_ids"])
    tool_positions = {start + i for start, count in spans for i in range(count)}
    assert [i for i, m in enumerate(mask) if m == 0] == sorted(tool_positions)
    assert sample["weight_version_start"] == calls[0][0] and sample["weight_version_end"] == calls[-1][1]
    versions = [v for call in calls for v in call]
    assert versions == sorted(versions)  # calls in order, each within [start, end]
    for call, asked in zip(calls, sample["metadata"]["requested_versions"]):
        assert call[0] >= asked["min_version"]
    assert consumed_at - sample["weight_version_start"] <= 1
    assert all(sample["response_logprobs"][i] == 0.0 for i in tool_positions)
    return len(tool_positions)
