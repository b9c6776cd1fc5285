"""Killing a trainer rank of a running job from outside it (issue 30: trainer restarts; reused by
the chaos test).

A trainer rank is a Ray worker process whose title Ray sets to ``ray::TrainerRank`` (plus the
method it runs). A driver that started its own local Ray is the ancestor of that Ray's raylet and
so of every worker: ``root_pid`` = the driver keeps the search inside one run when several run at
once (pytest-xdist). On a cluster of raylets started with ``ray start`` (which leaves its
processes to init), start the trainer's raylet with a marker in its environment, which every
worker inherits, and pass ``env=(NAME, VALUE)`` instead.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil

TRAINER_RANK_TITLE = "ray::TrainerRank"


def trainer_rank_pids(root_pid: int | None = None, env: tuple[str, str] | None = None) -> list[int]:
    """Pids of the live trainer rank processes under ``root_pid`` (None: all of this user's) whose
    environment has ``env`` (if given), in pid order (the order the ranks were started in, as far
    as the OS handed out pids in order)."""
    try:
        candidates = psutil.Process(root_pid).children(recursive=True) if root_pid else psutil.process_iter()
    except psutil.NoSuchProcess:
        return []
    found = []
    for process in candidates:
        try:
            if process.status() == psutil.STATUS_ZOMBIE:
                continue
            if not " ".join(process.cmdline()).startswith(TRAINER_RANK_TITLE) or process.uids().real != os.getuid():
                continue
            if env is None or process.environ().get(env[0]) == env[1]:
                found.append(process.pid)
        except psutil.Error:
            continue
    return sorted(found)


def kill_trainer_rank(root_pid: int | None = None, index: int = 0, timeout_s: float = 120.0,
                      env: tuple[str, str] | None = None, freeze_pid: int | None = None) -> int:
    """SIGKILL the ``index``-th trainer rank process (``trainer_rank_pids(root_pid, env)`` order),
    waiting up to ``timeout_s`` for it to exist; returns its pid. ``AssertionError`` when none
    appeared. ``freeze_pid`` (the run's driver) is stopped (SIGSTOP) while the rank is found and
    killed, then continued: a tiny run's remaining steps can take less time than finding the
    rank, and a kill after the last trainer call would not be a mid-run failure."""
    deadline = time.monotonic() + timeout_s
    while True:
        if freeze_pid is not None:
            os.kill(freeze_pid, signal.SIGSTOP)
        try:
            pids = trainer_rank_pids(root_pid, env)
            if len(pids) > index:
                os.kill(pids[index], signal.SIGKILL)
                return pids[index]
        finally:
            if freeze_pid is not None:
                os.kill(freeze_pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"no trainer rank {index} under pid {root_pid} within {timeout_s:.0f}s"
        time.sleep(0.2)


def wait_for_step(run_dir: str | Path, step: int, timeout_s: float, alive=None) -> None:
    """Until ``run_dir/metrics.jsonl`` holds a record of ``step`` (``alive()``, if given, is asserted
    meanwhile: e.g. that the run's process has not exited)."""
    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line).get("step") == step:
                        return
                except ValueError:
                    continue
        if alive is not None:
            assert alive(), f"the run ended before step {step}"
        assert time.monotonic() < deadline, f"no record of step {step} within {timeout_s:.0f}s"
        time.sleep(0.02)
