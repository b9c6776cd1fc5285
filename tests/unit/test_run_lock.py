"""A run directory belongs to one run (issue 29): a second run exits 2 at once naming the holder's pid
and host, a dead run's lock is taken over with a warning, default run directories never collide."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from miles_disagg.loop.run_lock import LOCK_FILENAME, RunDirLock, RunDirLocked

HOLD = """
import sys, time
from miles_disagg.loop.run_lock import RunDirLock
lock = RunDirLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path: Path):
    """Another process holding ``tmp_path / 'run'``."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_a_second_run_is_refused_naming_the_holder(holder) -> None:
    run_dir, proc = holder
    with pytest.raises(RunDirLocked) as caught:
        RunDirLock.acquire(run_dir)
    message = str(caught.value)
    assert f"pid {proc.pid} on host {socket.gethostname()}" in message and "--run-dir" in message
    assert caught.value.flags == ("--run-dir",) and caught.value.holder["pid"] == proc.pid


def test_the_launcher_exits_2_at_once_and_writes_nothing(holder, tiny_qwen3_dir, capsys) -> None:
    from miles_disagg.launcher import main

    run_dir, proc = holder
    start = time.monotonic()
    code = main("train_async", ["--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
                                "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                                "--run-dir", str(run_dir)])
    err = capsys.readouterr().err
    assert code == 2 and f"pid {proc.pid}" in err and "Traceback" not in err
    assert time.monotonic() - start < 30  # no Ray, no wait: the machine's load is all it costs
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILENAME]  # no config.json, no records touched


def test_a_dead_runs_lock_is_taken_over_with_a_warning(holder, capsys) -> None:
    run_dir, proc = holder
    os.kill(proc.pid, signal.SIGKILL)  # dies holding it: the kernel drops the flock, the record stays
    proc.wait()
    with RunDirLock.acquire(run_dir) as lock:
        err = capsys.readouterr().err
        assert "taking over the lock of a run that ended without releasing it" in err and f"pid {proc.pid}" in err
        assert json.loads((run_dir / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    record = json.loads((run_dir / LOCK_FILENAME).read_text())
    assert record["released"] is True
    with RunDirLock.acquire(run_dir):  # a released lock is taken without a warning
        assert "taking over" not in capsys.readouterr().err


def test_a_lock_is_held_against_this_process_too(tmp_path: Path) -> None:
    with RunDirLock.acquire(tmp_path / "run"):
        with pytest.raises(RunDirLocked, match=f"pid {os.getpid()}"):
            RunDirLock.acquire(tmp_path / "run")
    RunDirLock.acquire(tmp_path / "run").release()


@pytest.mark.parametrize("content", [b"", b"x" * (70 * 1024), b"[[[[", b'"a string"', b"\xff\xfe"])
def test_a_hostile_lock_record_is_named_unknown_and_taken_over(tmp_path: Path, content: bytes, capsys) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / LOCK_FILENAME).write_bytes(content)
    with RunDirLock.acquire(run_dir):
        pass
    assert "taking over" not in capsys.readouterr().err  # nothing known of a holder: nothing to warn about


def test_the_locked_error_survives_pickling(holder) -> None:
    import pickle

    run_dir, proc = holder
    with pytest.raises(RunDirLocked) as caught:
        RunDirLock.acquire(run_dir)
    copy = pickle.loads(pickle.dumps(caught.value))
    assert str(copy) == str(caught.value) and copy.holder == caught.value.holder and copy.flags == ("--run-dir",)


def test_default_run_dirs_started_in_the_same_second_differ() -> None:
    from miles_disagg.config import RunConfig
    from miles_disagg.config.loader import fill_run_paths

    now = time.time()
    dirs = set()
    for _ in range(20):
        config = RunConfig()
        fill_run_paths(config, now=now)
        dirs.add(config.tracking.run_dir)
    assert len(dirs) == 20 and all(d.startswith(str(Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.localtime(now))))
                                    for d in dirs)


def test_default_run_dirs_of_two_processes_in_the_same_second_differ(tmp_path: Path) -> None:
    """Two ``train_async.py`` started together (``--print-config`` shows where each would write)."""
    repo = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, str(repo / "train_async.py"), "--hf-checkpoint", "x", "--print-config"],
                              stdout=subprocess.PIPE, text=True, cwd=tmp_path) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    dirs = [next(line.split(": ", 1)[1] for line in out.splitlines() if line.strip().startswith("run_dir:"))
            for out in outputs]
    assert all(d.startswith("runs/") for d in dirs) and dirs[0] != dirs[1], dirs


@pytest.mark.parametrize("flag", ["--update-weight-disk-dir", "--save"])
def test_a_shared_store_or_save_dir_outside_the_run_dirs_is_held_too(tmp_path: Path, tiny_qwen3_dir, capsys,
                                                                     flag) -> None:
    """A second run publishing into a store another live run publishes into would reset it under that run;
    its saves would mix with the other's."""
    from miles_disagg.launcher import main

    store = tmp_path / "shared"
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(store)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        code = main("train_async", ["--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "1",
                                    "--rollout-batch-size", "4", "--actor-num-gpus-per-node", "1", "--rollout-num-gpus",
                                    "1", "--run-dir", str(tmp_path / "run"), "--update-weight-transfer-mode", "disk-delta",
                                    flag, str(store)])
        err = capsys.readouterr().err
        assert code == 2 and f"{flag} '{store}' is in use by another run (pid {proc.pid}" in err, err
        assert f"give this run its own {flag}" in err
        assert json.loads((tmp_path / "run" / LOCK_FILENAME).read_text())["released"] is True  # the run dir's, let go
    finally:
        proc.kill()
        proc.wait()


def test_an_uncreatable_run_dir_exits_2(tmp_path: Path, tiny_qwen3_dir, capsys) -> None:
    from miles_disagg.launcher import main

    (tmp_path / "file").write_text("")
    code = main("train_async", ["--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
                                "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1",
                                "--run-dir", str(tmp_path / "file" / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "--run-dir" in err and "cannot create run.lock there" in err and "Traceback" not in err


def test_a_dry_run_warns_of_a_held_run_dir_without_locking_it(holder, tiny_qwen3_dir, capsys) -> None:
    from miles_disagg.launcher import main

    run_dir, proc = holder
    argv = ["--hf-checkpoint", str(tiny_qwen3_dir), "--num-rollout", "1", "--rollout-batch-size", "4",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--run-dir", str(run_dir), "--dry-run"]
    assert main("train_async", argv) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any(w.startswith(f"--run-dir {run_dir} appears to be in use by another run (pid {proc.pid}") for w in warnings)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert main("train_async", argv) == 0  # its holder is gone: nothing to warn about
    assert not any("appears to be in use" in w for w in json.loads(capsys.readouterr().out)["warnings"])
