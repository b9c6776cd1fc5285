"""Save, crash, resume: a run killed with SIGKILL continues from its last complete save
without breaking version identity (issue: save, resume and evaluate)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from checkpoint_reading import read_state

from miles_disagg.loop.report import join_updates
from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest, read_complete
from miles_disagg.weights.store import VersionStore

REPO = Path(__file__).resolve().parents[2]
OPTIMIZER_STEPS_PER_ROLLOUT = 2  # tiny config: 256 samples per rollout, global batch 128
# a group dropped as stale leaves the data position too (a resumed run would drop it as well): how
# many are dropped depends on the machine's load, so these runs keep every group to count exactly
NO_STALE_DROPS = ("--max-weight-staleness", "1000")


def command(tmp: Path, num_rollout: int, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
            "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
            "--num-rollout", str(num_rollout), "--save", str(tmp / "saves"), "--save-interval", "2",
            "--eval-interval", "2", "--eval-prompt-data", "digits", "task:count-up", "--eval-max-prompts", "16",
            *NO_STALE_DROPS, *extra]


def environment() -> dict[str, str]:
    return {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
            "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def crashed_and_resumed(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("resume")
    crash = subprocess.Popen(command(tmp, 60), cwd=tmp, env=environment(), stdout=subprocess.DEVNULL,
                             stderr=open(tmp / "crash.log", "wb"), start_new_session=True)
    deadline = time.monotonic() + 180
    while read_complete(tmp / "saves" / "iter_0000004") is None:
        assert crash.poll() is None, (tmp / "crash.log").read_text()[-4000:]
        assert time.monotonic() < deadline, "no save at step 4"
        time.sleep(0.05)
    os.killpg(crash.pid, signal.SIGKILL)  # the whole job dies at once, mid-run
    crash.wait()
    store = VersionStore(tmp / "run" / "weight-updates")
    at_crash = store.latest()
    # a save torn mid-write (newer than every good one) must be ignored
    torn = tmp / "saves" / "iter_0000008"
    shutil.copytree(find_latest(tmp / "saves")[0], torn)
    meta = json.loads((torn / "meta.json").read_text())
    (torn / "meta.json").write_text(json.dumps({**meta, "step": 8}))
    with open(next((torn / "state").glob("*.distcp")), "r+b") as f:
        f.truncate(100)
    newest_good = find_latest(tmp / "saves")[0]
    resumed = subprocess.run(command(tmp, newest_good_step(newest_good) + 3, "--load", str(tmp / "saves")),
                             cwd=tmp, env=environment(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    return tmp, at_crash, newest_good, resumed


def newest_good_step(path: Path) -> int:
    return read_complete(path).step



def test_the_torn_save_is_ignored(crashed_and_resumed) -> None:
    _, _, newest_good, resumed = crashed_and_resumed
    assert newest_good.name != "iter_0000008"
    assert f"resuming from {newest_good}" in resumed.stderr


def test_step_optimizer_and_data_position_continue(crashed_and_resumed) -> None:
    tmp, _, newest_good, _ = crashed_and_resumed
    start = newest_good_step(newest_good)
    records = [r for r in read_metrics(tmp / "run" / "metrics.jsonl")]
    resumed_steps = [r["step"] for r in records][-3:]
    assert resumed_steps == [start, start + 1, start + 2]
    final_path, final = find_latest(tmp / "saves")
    assert final.step == start + 3 and final.run_id == read_complete(newest_good).run_id
    assert final.data_position == (start + 3) * 32  # every consumed prompt counted once, across the crash
    steps = {int(value) for key, value in read_state(final_path)["optimizer"].items() if key.endswith(".step")}
    assert steps == {(start + 3) * OPTIMIZER_STEPS_PER_ROLLOUT}  # Adam's moments continued, not restarted


def test_first_version_after_resume_is_latest_plus_one_of_the_same_run(crashed_and_resumed) -> None:
    tmp, at_crash, newest_good, resumed = crashed_and_resumed
    saved = read_complete(newest_good)
    store = VersionStore(tmp / "run" / "weight-updates")
    assert at_crash.run_id == saved.run_id and at_crash.version >= saved.version
    first_record = read_metrics(tmp / "run" / "metrics.jsonl")[-3]
    if at_crash.version != saved.version:  # the store moved on after the save: a full republish
        assert f"republished the trainer's state as full v{at_crash.version + 1}" in resumed.stderr
        index = json.loads((store.version_dir(at_crash.version + 1) / "model.safetensors.index.json").read_text())
        assert index["metadata"]["delta_encoding"] == "full"
        assert first_record["weights/version"] == at_crash.version + 2
    else:
        assert first_record["weights/version"] == at_crash.version + 1
    assert f"engines at v{first_record['weights/version'] - 1}" in resumed.stderr
    joined = join_updates(read_metrics(tmp / "run" / "metrics.jsonl"), read_metrics(tmp / "run" / "updates.jsonl"))
    for record in joined[-3:]:  # each activation is logged to updates.jsonl once it finished
        assert record["weights/engine_versions"] == [str(record["weights/version"])] * 2
    assert store.latest().run_id == saved.run_id


def test_eval_uses_the_exact_current_version(crashed_and_resumed) -> None:
    tmp, _, _, _ = crashed_and_resumed
    evaluated = [r for r in read_metrics(tmp / "run" / "metrics.jsonl") if "eval/digits" in r]
    assert evaluated
    for record in evaluated:
        assert record["eval/digits_version"] == record["weights/version"]
        assert record["eval/digits_samples"] == 16 and 0 <= record["eval/digits"] <= 1
