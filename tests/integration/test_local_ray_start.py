"""A local Ray whose node does not come up in time (its agents start slower than the raylet
waits, on a loaded machine) is started once more, after the failed start's processes are stopped;
local Ray starts on one machine take turns (``local_ray_start_turn``), and the tests' own starts
(``tests/ray_start.py``) retry a node start that timed out the same way."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


class _Started(Exception):
    pass


def test_a_node_that_timed_out_is_started_again_and_its_leftovers_are_stopped(monkeypatch, capsys, tmp_path):
    import ray

    from miles_disagg.loop import job
    from miles_disagg.net.netbind import LOCAL_RAY_ENV, WORKER_ENV

    for name in (LOCAL_RAY_ENV, *WORKER_ENV):  # whatever init_ray sets there is undone after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    # a leftover of the failed start (a program under .../ray/) and a child that is not Ray's
    fake_agent = tmp_path / "ray" / "dashboard" / "agent.py"
    fake_agent.parent.mkdir(parents=True)
    fake_agent.write_text("import time\ntime.sleep(120)\n")
    leftover = subprocess.Popen([sys.executable, str(fake_agent)])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    attempts = []

    def fake_init(**options):
        attempts.append(options)
        if len(attempts) < 3:  # two starts time out (a loaded machine); the third comes up
            raise Exception("The current node timed out during startup. This could happen because some of "
                            "the raylet failed to startup or the GCS has become overloaded.")
        raise _Started()

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    try:
        with pytest.raises(_Started):
            job.init_ray(2)
        assert len(attempts) == 3 and attempts[0] == attempts[1] == attempts[2]
        assert leftover.wait(timeout=30) is not None  # stopped before the next start
        assert other.poll() is None  # not Ray's: left alone
        assert "the local Ray did not come up in time (The current node timed out during startup." in \
            capsys.readouterr().err
    finally:
        for proc in (leftover, other):
            proc.kill()
            proc.wait()


def test_any_other_start_failure_is_not_retried(monkeypatch):
    import ray

    from miles_disagg.loop import job
    from miles_disagg.net.netbind import LOCAL_RAY_ENV, WORKER_ENV

    for name in (LOCAL_RAY_ENV, *WORKER_ENV):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    attempts = []

    def fake_init(**options):
        attempts.append(options)
        raise ValueError("bad option")

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(ValueError, match="bad option"):
        job.init_ray(2)
    assert len(attempts) == 1


def test_local_ray_starts_on_one_machine_take_turns_and_a_dead_holder_frees_its_turn(tmp_path):
    """``local_ray_start_turn``: another process waits while one holds the turn (up to its wait,
    then goes anyway); the holder's death frees it at once; re-entrant within a thread."""
    import time

    from miles_disagg.loop.ray_start import local_ray_start_turn

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom miles_disagg.loop.ray_start import "
                               "local_ray_start_turn\nwith local_ray_start_turn():\n    print('held', flush=True)\n"
                               "    time.sleep(120)\n"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with local_ray_start_turn(wait_s=1.0) as had:
            assert had is False and time.monotonic() - started >= 1.0  # waited, then went anyway
        holder.kill()
        holder.wait()
        with local_ray_start_turn(wait_s=30.0) as had:
            assert had is True
            with local_ray_start_turn(wait_s=0.0) as again:  # (ray.init guarded by the tests inside a run's turn)
                assert again is True
    finally:
        holder.kill()
        holder.wait()


def test_the_tests_start_a_node_that_timed_out_again_after_cleaning_up():
    from ray_start import start_retrying

    from miles_disagg.loop.ray_start import LOCAL_RAY_START_ATTEMPTS

    calls, cleaned = [], []

    def start():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("ray start (head) exited with 1: The current node timed out during startup.")
        return "up"

    assert start_retrying(start, lambda: cleaned.append(1), "test") == "up"
    assert (len(calls), len(cleaned)) == (2, 1)
    tries = []

    def never_up():
        tries.append(1)
        raise RuntimeError("ray start (head) exited with 1: The current node timed out during startup.")

    with pytest.raises(RuntimeError, match="timed out during startup"):  # every try timed out: the last raises
        start_retrying(never_up, lambda: None, "test")
    assert len(tries) == LOCAL_RAY_START_ATTEMPTS == 3
    with pytest.raises(ValueError):
        start_retrying(lambda: (_ for _ in ()).throw(ValueError("bad option")), lambda: cleaned.append(1), "test")
    assert len(cleaned) == 1  # any other failure is not retried
