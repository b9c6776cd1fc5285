"""Interrupt, resume, crash, resume with another rank count, through ``train_async.py`` as a user runs it.

1. A saving one-rank run gets Ctrl-C (SIGINT to its process group, as a terminal sends it) once it
   completed 3 steps: it exits 130 with one line and leaves summary.json and report.png of the steps
   before (issue 29, the first hour of a new user).
2. ``--load`` continues it; while it holds the run directory a second run on it exits 2 at once
   naming the holder. Then the whole job is killed with SIGKILL, mid-run.
3. A torn newer save is planted; two trainer ranks resume from the newest good save and finish, with
   every step's record once, without breaking version identity (issue: save, resume and evaluate;
   issue 13: a run saved with N trainer ranks resumes with M).

Three whole runs carry every check (each costs half a minute of CPU). All train with GSPO
(``--advantage-estimator gspo``, issue 37: GSPO resumes from a save)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from run_flags import ONE_ENGINE
from run_waits import wait_while_running
from deadlines import scaled
from checkpoint_reading import read_state
from base_model import place_base_model

from miles_disagg.loop.report import join_updates
from miles_disagg.tracking import read_metrics
from miles_disagg.trainer.checkpoint import find_latest, read_complete
from miles_disagg.weights.store import VersionStore

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)  # three whole runs in the module fixture (scaled by the load: e2e conftest)
PROMPTS_PER_ROLLOUT = 8  # groups of 8 samples: 64 samples per rollout
OPTIMIZER_STEPS_PER_ROLLOUT = 2  # global batch 32
RESUMED_STEPS = 3
# a group dropped as stale leaves the data position too (a resumed run would drop it as well): how
# many are dropped depends on the machine's load, so these runs keep every group to count exactly
NO_STALE_DROPS = ("--max-weight-staleness", "1000")


def command(tmp: Path, num_rollout: int, num_ranks: int, *extra: str) -> list[str]:
    return [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
            "--run-dir", str(tmp / "run"), "--hf-checkpoint", str(tmp / "base-model"),
            "--num-rollout", str(num_rollout), "--actor-num-gpus-per-node", str(num_ranks),
            "--rollout-batch-size", str(PROMPTS_PER_ROLLOUT), "--global-batch-size", "32",
            "--save", str(tmp / "saves"), "--save-interval", "2",
            "--eval-interval", "2", "--eval-prompt-data", "digits", "task:count-up", "--eval-max-prompts", "16",
            "--advantage-estimator", "gspo", *NO_STALE_DROPS, *ONE_ENGINE, *extra]


JOB_ENV = "MILES_DISAGG_TEST_JOB"  # every process of a run inherits it: the driver, its Ray, ranks, engines


def environment(job: str = "") -> dict[str, str]:
    return {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
            "RAY_AUTH_MODE": "disabled", JOB_ENV: job or uuid.uuid4().hex}


def kill_the_whole_job(job: str, timeout_s: float = 60.0) -> None:
    """SIGKILL every process of the job at once, until none is left. A signal to the driver's
    process group is not enough: Ray starts its workers (the trainer ranks among them) in process
    groups of their own, and a rank outlives its driver by seconds (2.7 s measured on a quiet
    machine), long enough to commit one more version after the test read ``LATEST``."""
    import psutil

    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for proc in psutil.process_iter():
            try:
                if proc.environ().get(JOB_ENV) == job and proc.status() != psutil.STATUS_ZOMBIE:
                    proc.kill()
                    left.append(proc)
            except psutil.Error:
                continue
        if not left:
            return
        assert time.monotonic() < deadline, f"processes of the job outlived SIGKILL: {[p.pid for p in left]}"
        psutil.wait_procs(left, timeout=1.0)


QUIET_PREFLIGHT_S = 8.0  # a refused launch: Python, the config, the check; no Ray


def interrupt_after_3_steps(tmp: Path) -> dict:
    """Run 1: Ctrl-C once 3 steps are recorded and a save exists."""
    log = tmp / "interrupted.log"
    first = subprocess.Popen(command(tmp, 60, 1), cwd=tmp, env=environment(), stdout=subprocess.DEVNULL,
                             stderr=open(log, "wb"), start_new_session=True)
    metrics = tmp / "run" / "metrics.jsonl"
    wait_while_running(lambda: metrics.exists() and len(read_metrics(metrics)) >= 3 and find_latest(tmp / "saves"),
                       first, log, scaled(240), "3 steps and a save", poll_s=0.05)
    os.killpg(first.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
    first.wait(timeout=scaled(120))
    return {"code": first.returncode, "stderr": log.read_text(), "steps": len(read_metrics(metrics)),
            "summary": json.loads((tmp / "run" / "summary.json").read_text()),
            "report_size": (tmp / "run" / "report.png").stat().st_size, "save": find_latest(tmp / "saves")[0]}


def resume_then_crash(tmp: Path, interrupted_save: Path) -> dict:
    """Run 2: ``--load`` continues run 1; a second run on the held directory is started; once the
    resumed run saved twice more the whole job is killed."""
    job, log = uuid.uuid4().hex, tmp / "crash.log"
    crash = subprocess.Popen(command(tmp, 60, 1, "--load", str(tmp / "saves")), cwd=tmp, env=environment(job),
                             stdout=subprocess.DEVNULL, stderr=open(log, "wb"), start_new_session=True)
    lock = tmp / "run" / "run.lock"
    wait_while_running(lambda: lock.exists() and f'"pid": {crash.pid},' in lock.read_text(), crash, log, scaled(60),
                       "lock taken by the resumed run", poll_s=0.05)
    metrics = tmp / "run" / "metrics.jsonl"
    records_before = metrics.read_bytes()
    start = time.monotonic()
    second = subprocess.run(command(tmp, 5, 1), cwd=tmp, env=environment(), capture_output=True, text=True,
                            timeout=scaled(120))
    second_s = time.monotonic() - start
    # the refused run leaves the records alone (the resumed run itself may replace its latest steps' records)
    assert metrics.read_bytes().startswith(records_before[:len(records_before) // 2])
    twice_more = tmp / "saves" / f"iter_{read_complete(interrupted_save).step + 4:07d}"
    wait_while_running(lambda: read_complete(twice_more) is not None, crash, log, scaled(300), f"save {twice_more.name}",
                       poll_s=0.05)
    kill_the_whole_job(job)  # the whole job dies at once, mid-run
    crash.wait()
    return {"stderr": log.read_text(), "second": second, "second_s": second_s}


@pytest.fixture(scope="module")
def interrupted_crashed_resumed(tmp_path_factory: pytest.TempPathFactory, digits_base_model: Path):
    tmp = tmp_path_factory.mktemp("resume")
    place_base_model(digits_base_model, tmp)
    interrupted = interrupt_after_3_steps(tmp)
    crashed = resume_then_crash(tmp, interrupted["save"])
    store = VersionStore(tmp / "run" / "weight-updates")
    at_crash = store.latest()  # no process of the crashed job is left to move it
    # a save torn mid-write (newer than every good one) must be ignored
    torn = tmp / "saves" / "iter_0000099"
    shutil.copytree(find_latest(tmp / "saves")[0], torn)
    meta = json.loads((torn / "meta.json").read_text())
    (torn / "meta.json").write_text(json.dumps({**meta, "step": 99}))
    with open(next((torn / "state").glob("*.distcp")), "r+b") as f:
        f.truncate(100)
    newest_good = find_latest(tmp / "saves")[0]
    resumed = subprocess.run(command(tmp, newest_good_step(newest_good) + RESUMED_STEPS, 2, "--load", str(tmp / "saves")),
                             cwd=tmp, env=environment(), capture_output=True, text=True, timeout=scaled(300))
    assert resumed.returncode == 0, resumed.stderr[-6000:]
    return {"tmp": tmp, "interrupted": interrupted, "crashed": crashed, "at_crash": at_crash,
            "newest_good": newest_good, "resumed": resumed}


@pytest.fixture(scope="module")
def crashed_and_resumed(interrupted_crashed_resumed):
    """(tmp, the store's latest at the crash, the newest good save, the two-rank resumed run)."""
    runs = interrupted_crashed_resumed
    return runs["tmp"], runs["at_crash"], runs["newest_good"], runs["resumed"]


def test_ctrl_c_exits_130_with_one_line_and_the_report_of_completed_steps(interrupted_crashed_resumed) -> None:
    first, tmp = interrupted_crashed_resumed["interrupted"], interrupted_crashed_resumed["tmp"]
    err, steps = first["stderr"], first["steps"]
    assert first["code"] == 130, err[-4000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-4000:]
    lines = [line for line in err.splitlines() if "interrupted" in line]
    assert lines == [f"train_async.py: interrupted (SIGINT) at step {steps}; summary.json and report.png of steps "
                     f"before {steps} in {tmp / 'run'}; resume with --load {tmp / 'saves'}"], err[-3000:]
    assert first["summary"]["steps"] == steps and first["report_size"] > 1000


def test_load_continues_an_interrupted_run(interrupted_crashed_resumed) -> None:
    runs = interrupted_crashed_resumed
    assert f"resuming from {runs['interrupted']['save']}" in runs["crashed"]["stderr"], runs["crashed"]["stderr"][-4000:]
    saved = read_complete(runs["newest_good"])
    assert saved.step >= read_complete(runs["interrupted"]["save"]).step + 4  # it trained on, and saved


def test_a_second_run_on_a_held_run_dir_exits_2_at_once(interrupted_crashed_resumed) -> None:
    second, second_s = interrupted_crashed_resumed["crashed"]["second"], interrupted_crashed_resumed["crashed"]["second_s"]
    assert second.returncode == 2, second.stderr[-3000:]
    assert "is in use by another run" in second.stderr and f"on host {socket.gethostname()}" in second.stderr
    assert "Traceback" not in second.stderr and second_s < scaled(QUIET_PREFLIGHT_S)


def test_the_resumed_run_ends_with_every_steps_record_once(interrupted_crashed_resumed) -> None:
    tmp, resumed = interrupted_crashed_resumed["tmp"], interrupted_crashed_resumed["resumed"]
    total = newest_good_step(interrupted_crashed_resumed["newest_good"]) + RESUMED_STEPS
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(total)), resumed.stderr[-3000:]
    assert json.loads((tmp / "run" / "summary.json").read_text())["steps"] == total
    assert json.loads((tmp / "run" / "run.lock").read_text())["released"] is True


def newest_good_step(path: Path) -> int:
    return read_complete(path).step


def test_the_torn_save_is_ignored(crashed_and_resumed) -> None:
    tmp, _, newest_good, resumed = crashed_and_resumed
    assert newest_good.name != "iter_0000099"
    assert f"resuming from {newest_good}" in resumed.stderr
    assert json.loads((tmp / "run" / "config.json").read_text())["train"]["advantage_estimator"] == "gspo"


def test_the_one_rank_save_is_resumed_by_two_ranks(crashed_and_resumed) -> None:
    tmp, _, newest_good, resumed = crashed_and_resumed
    assert read_complete(newest_good).world_size == 1
    assert sorted(p.name for p in (newest_good / "rng").iterdir()) == ["rank0.pt"]
    assert "written by 1 trainer ranks, this job has 2" in resumed.stderr
    final_save, final = find_latest(tmp / "saves")
    assert final.world_size == 2 and final.step == newest_good_step(newest_good) + RESUMED_STEPS
    assert sorted(p.name for p in (final_save / "rng").iterdir()) == ["rank0.pt", "rank1.pt"]


def test_step_optimizer_and_data_position_continue(crashed_and_resumed) -> None:
    tmp, _, newest_good, _ = crashed_and_resumed
    start = newest_good_step(newest_good)
    assert read_complete(newest_good).data_position == start * PROMPTS_PER_ROLLOUT
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    resumed_steps = [r["step"] for r in records][-RESUMED_STEPS:]
    assert resumed_steps == [start, start + 1, start + 2]
    assert json.loads((tmp / "run" / "summary.json").read_text())["steps"] == start + RESUMED_STEPS
    final_path, final = find_latest(tmp / "saves")
    assert final.step == start + RESUMED_STEPS and final.run_id == read_complete(newest_good).run_id
    # every consumed prompt counted once, across the crash and the change of rank count
    assert final.data_position == (start + RESUMED_STEPS) * PROMPTS_PER_ROLLOUT
    steps = {int(value) for key, value in read_state(final_path)["optimizer"].items() if key.endswith(".step")}
    assert steps == {(start + RESUMED_STEPS) * OPTIMIZER_STEPS_PER_ROLLOUT}  # Adam's moments continued, not restarted


def test_first_version_after_resume_is_latest_plus_one_of_the_same_run(crashed_and_resumed) -> None:
    tmp, at_crash, newest_good, resumed = crashed_and_resumed
    saved = read_complete(newest_good)
    store = VersionStore(tmp / "run" / "weight-updates")
    assert at_crash.run_id == saved.run_id and at_crash.version >= saved.version
    records = read_metrics(tmp / "run" / "metrics.jsonl")
    first_record = records[-RESUMED_STEPS]
    if at_crash.version != saved.version:  # the store moved on after the save: a full republish
        assert f"republished the trainer's state as full v{at_crash.version + 1}" in resumed.stderr
        index = json.loads((store.version_dir(at_crash.version + 1) / "model.safetensors.index.json").read_text())
        assert index["metadata"]["delta_encoding"] == "full"
        assert first_record["weights/version"] == at_crash.version + 2
    else:
        assert first_record["weights/version"] == at_crash.version + 1
    assert f"engines at v{first_record['weights/version'] - 1}" in resumed.stderr
    resumed_versions = [r["weights/version"] for r in records[-RESUMED_STEPS:]]
    assert resumed_versions == sorted(set(resumed_versions))  # never a number reused
    assert store.latest().version == resumed_versions[-1] == read_complete(find_latest(tmp / "saves")[0]).version
    joined = join_updates(records, read_metrics(tmp / "run" / "updates.jsonl"))
    for record in joined[-RESUMED_STEPS:]:  # each activation is logged to updates.jsonl once it finished
        assert record["weights/engine_versions"] == [str(record["weights/version"])]
    assert store.latest().run_id == saved.run_id


def test_eval_uses_the_exact_current_version(crashed_and_resumed) -> None:
    tmp, _, _, _ = crashed_and_resumed
    evaluated = [r for r in read_metrics(tmp / "run" / "metrics.jsonl") if "eval/digits" in r]
    assert evaluated
    for record in evaluated:
        assert record["eval/digits_version"] == record["weights/version"]
        assert record["eval/digits_samples"] == 16 and 0 <= record["eval/digits"] <= 1
