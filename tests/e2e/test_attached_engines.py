"""``train_async.py --rollout-external`` against engines an earlier job left at its version 4:
they are brought to this job's base (version 0) before any request, then follow this job."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
INTEGRATION = REPO / "tests" / "integration"


@pytest.fixture()
def engines_at_an_earlier_jobs_v4(tmp_path: Path):
    sys.path.insert(0, str(INTEGRATION))
    from rollout_fixtures import VersionSource

    from miles_disagg.engines.client import EngineClient
    from miles_disagg.engines.launch import launch_engine
    from miles_disagg.models.tiny_qwen3 import CHARSETS, make_tiny_qwen3

    base = make_tiny_qwen3(tmp_path / "base-model", seed=1234, charset=CHARSETS["digits"])
    # each engine's roots: the stores it may pull from (the earlier job's and this job's) and its checkpoint
    stores = ["--weight-store-dir", str(tmp_path / "earlier-job-store"),
              "--weight-store-dir", str(tmp_path / "run" / "weight-updates")]
    engines = [launch_engine(base, log_path=tmp_path / f"engine-{i}.log",
                             extra_args=[*stores, "--local-checkpoint-dir", str(tmp_path / f"engine-local-{i}")])
               for i in range(2)]
    earlier = VersionSource(tmp_path / "earlier-job-store", base)
    try:
        for seed in range(4):
            earlier.publish_next(seed=seed)
        for i, engine in enumerate(engines):
            with EngineClient(engine.url, store_dir=tmp_path / "earlier-job-store",
                              local_checkpoint_dir=tmp_path / f"engine-local-{i}") as client:
                client.pull(4)
                client.pause("retract")
                client.load(4)
                client.resume()
                assert client.weight_version() == "4"
        yield base, engines
    finally:
        earlier.close()
        for engine in engines:
            engine.stop()


def test_engines_of_an_earlier_job_are_brought_to_this_jobs_base_first(engines_at_an_earlier_jobs_v4, tmp_path):
    base, engines = engines_at_an_earlier_jobs_v4
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
         "--hf-checkpoint", str(base), "--run-dir", str(run_dir), "--num-rollout", "2", "--rollout-batch-size", "4",
         "--global-batch-size", "32", "--rollout-external", "--rollout-external-engine-addrs",
         *[e.url.removeprefix("http://") for e in engines]],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    records = read_metrics(run_dir / "metrics.jsonl")
    updates = read_metrics(run_dir / "updates.jsonl")  # each activation, after its step's record
    assert [u["weights/engine_versions"] for u in updates] == [["1", "1"], ["2", "2"]]
    assert all(r["rollout/served_version_mean"] <= r["step"] for r in records)  # never the earlier job's v4
