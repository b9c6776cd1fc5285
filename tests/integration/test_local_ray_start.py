"""A local Ray whose node does not come up in time (its agents start slower than the raylet
waits, on a loaded machine) is started once more, after the failed start's processes are stopped."""

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
        if len(attempts) == 1:
            raise Exception("The current node timed out during startup. This could happen because some of "
                            "the raylet failed to startup or the GCS has become overloaded.")
        raise _Started()

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    try:
        with pytest.raises(_Started):
            job.init_ray(2)
        assert len(attempts) == 2 and attempts[0] == attempts[1]
        assert leftover.wait(timeout=30) is not None  # stopped before the second start
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
