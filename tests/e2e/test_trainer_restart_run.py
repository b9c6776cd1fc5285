"""A trainer rank killed mid-run restarts the trainer group inside the run (issue 30, item 3):
``train_async.py --max-trainer-restarts 1`` on one engine, a rank SIGKILLed once after step 4's
record; the run ends with exit 0, every step is recorded once, the version stream goes on without
a reused or torn number (``weights verify`` replays the newest from the base), and the summary
names the restart. One whole run carries every check."""

from __future__ import annotations

import json
from collections import Counter
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from base_model import place_base_model
from deadlines import scaled
from trainer_faults import kill_trainer_rank, wait_for_step

from miles_disagg.tracking import read_metrics, read_records
from miles_disagg.weights.store import VersionStore

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(420)  # one whole run (scaled by the load: e2e conftest)
NUM_ROLLOUT = 7
SAVE_INTERVAL = 3  # saves at steps 3 (v3) and 6
KILL_AFTER_STEP = 4  # v4 and v5 published after the step-3 save, and groups generated on them


def command(tmp: Path) -> list[str]:
    return [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
            "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
            "--num-rollout", str(NUM_ROLLOUT), "--rollout-num-gpus", "1", "--rollout-batch-size", "4",
            "--global-batch-size", "32", "--micro-batch-size", "32",
            "--save", str(tmp / "saves"), "--save-interval", str(SAVE_INTERVAL), "--max-trainer-restarts", "1",
            "--save-debug-rollout-data", str(tmp / "consumed" / "{rollout_id}.jsonl")]


@pytest.fixture(scope="module")
def restarted_run(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path):
    tmp = tmp_path_factory.mktemp("trainer-restart")
    place_base_model(digits_base_model, tmp)
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled"}
    log = tmp / "run.log"
    with open(log, "wb") as stderr:
        run = subprocess.Popen(command(tmp), cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                               start_new_session=True)
        try:
            wait_for_step(tmp / "run", KILL_AFTER_STEP, scaled(300), alive=lambda: run.poll() is None)
            killed = kill_trainer_rank(run.pid, freeze_pid=run.pid)  # the driver waits until the rank is dead
            returncode = run.wait(timeout=scaled(300))
        finally:
            if run.poll() is None:
                os.killpg(run.pid, 9)
                run.wait()
    return tmp, killed, returncode, log.read_text()


def test_the_run_finishes_after_the_restart(restarted_run) -> None:
    _, _, returncode, stderr = restarted_run
    assert returncode == 0, stderr[-6000:]
    assert "trainer failed at step" in stderr and "trainer rank 0 died" in stderr, stderr[-6000:]
    assert "(restart 1 of 1)" in stderr and "trainer restart 1 of 1: resumed from step" in stderr


def test_every_step_is_recorded_once(restarted_run) -> None:
    tmp, _, _, _ = restarted_run
    lines = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(NUM_ROLLOUT))
    per_step = Counter(r["rollout_step"] for r in read_records(tmp / "run" / "train_steps.jsonl"))
    assert sorted(per_step) == list(range(NUM_ROLLOUT)) and set(per_step.values()) == {1}  # one optimizer step each


def test_versions_are_never_reused_or_torn(restarted_run) -> None:
    tmp, _, _, _ = restarted_run
    store = VersionStore(tmp / "run" / "weight-updates")
    latest, visible = store.latest(), store.visible_versions()
    assert visible == list(range(visible[0], latest.version + 1))  # no gap; older than the newest anchor: pruned
    assert visible[0] == 1 or store.read_index(visible[0]).delta_encoding == "full"
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    versions = [r["weights/version"] for r in records]
    assert versions == sorted(set(versions))  # strictly increasing across the restart
    verified = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", "verify", "--store",
                               str(tmp / "run" / "weight-updates"), "--base-dir", str(tmp / "base-model")],
                              capture_output=True, text=True, timeout=scaled(120))
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["ok"] is True
    event = read_records(tmp / "run" / "events.jsonl")[0]
    if event["discarded_versions"]:  # the store moved on after the save: a full anchor with the next number
        first, last = event["discarded_versions"]
        assert event["version"] == last + 1
        assert store.read_index(event["version"]).delta_encoding == "full"


def test_the_summary_names_the_restart(restarted_run) -> None:
    tmp, _, _, stderr = restarted_run
    summary = json.loads((tmp / "run" / "summary.json").read_text())
    [restart] = summary["trainer_restarts"]
    assert restart["restart"] == 1 and restart["max_restarts"] == 1
    assert "trainer rank 0 died" in restart["failed"]
    assert restart["failed_at_step"] >= KILL_AFTER_STEP
    assert restart["resumed_from_step"] == SAVE_INTERVAL and restart["failed_at_step"] > KILL_AFTER_STEP
    assert f"trainer restart 1 of 1 at step {restart['failed_at_step']}" in stderr


def test_steps_after_the_restart_train_on_no_sample_of_the_lost_lineage(restarted_run) -> None:
    """Versions published after the save are not the restored trainer's: no group generated on
    one is consumed by the steps run again (each step's consumed groups, rewritten by its rerun)."""
    tmp, _, _, _ = restarted_run
    [event] = read_records(tmp / "run" / "events.jsonl")
    first, last = event["discarded_versions"]  # v4 .. v5 at least (the save holds v3)
    assert event["groups_dropped"] >= 0 and event["restart_s"] > 0
    assert first == SAVE_INTERVAL + 1 and last >= KILL_AFTER_STEP + 1
    lost = range(first, last + 1)
    for step in range(event["resumed_from_step"], NUM_ROLLOUT):
        groups = [json.loads(line) for line in (tmp / "consumed" / f"{step}.jsonl").read_text().splitlines()]
        assert groups
        for group in groups:
            assert group["consumed_at_version"] >= event["version"]
            for sample in group["samples"]:
                calls = sample["call_versions"] or [[sample["weight_version_start"], sample["weight_version_end"]]]
                assert not any(v in lost for start, end in calls for v in range(start, end + 1)), (step, calls)
