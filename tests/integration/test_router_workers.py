"""``miles-disagg router --router-workers 2``: two router processes on one port over simulated engines.

An engine that moves to version V is routed to for requests that require V only once both processes
know it: after the updater's ``set_worker_state(ready)`` returns, no process answers 409 for V, none ever
serves a request from an older version than it asked for, and a version one process learns from an
answer is routed on by both alike. Every request goes on a new connection, so the kernel spreads them
over both processes (checked with the processes' own counters)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_disagg.bench.processes import SimFleetProcess
from miles_disagg.bench.scale import ScaleBench
from miles_disagg.net.auth import ADMIN_API_KEY_ENV, ApiKeys
from miles_disagg.router.launch import launch_router

pytestmark = pytest.mark.timeout(300)
ADMIN_KEY = "router-workers-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BODY = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("router-workers")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_API_KEY_ENV, ADMIN_KEY)
        sim = SimFleetProcess.start(root / "sim.log", 3, ScaleBench(per_request_ms=20, pull_ms=10, load_ms=10))
        router = launch_router(log_path=root / "router.log", workers=sim.urls, health_check_interval_s=0.5,
                               extra_args=["--router-workers", "2", "--log-level", "info"])
        try:
            _wait(lambda: httpx.get(router.url + "/health").json()["router_workers"]["serving"] == 2, "both serving")
            yield sim, router, router.client(timeout_s=30)
        finally:
            router.stop()
            sim.stop()


def _wait(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _activate(engine_url: str, version: int) -> None:
    """Bring a simulated engine to ``version`` itself (stage, then load), as an engine's own update does."""
    with httpx.Client(base_url=engine_url, headers=ADMIN, timeout=30) as engine:
        staged = engine.post("/pull_weights", json={"target_version": version, "source_dir": "/s",
                                                    "local_checkpoint_dir": "/l"})
        assert staged.status_code == 200, staged.text
        loaded = engine.post("/update_weights_from_disk", json={"model_path": "/l", "weight_version": str(version)})
        assert loaded.status_code == 200, loaded.text


def _send(router_url: str, min_version: int) -> tuple[int, int | None]:
    """One request on a new connection: (status, the served start version)."""
    answer = httpx.post(router_url + "/generate", json={**BODY, "weight_version": {"min_version": min_version}},
                        timeout=30)
    start = answer.json()["meta_info"]["weight_version_start"] if answer.status_code == 200 else None
    return answer.status_code, start


def _requests_per_process(router_url: str) -> list[int]:
    return [p["requests"] for p in httpx.get(router_url + "/metrics").json()["router_workers"]["per_process"]]


class Hammer:
    """Threads sending requests that need ``min_version``, each on a new connection; every answer is kept
    as (sent at, status, served start version)."""

    def __init__(self, router_url: str, min_version: int, threads: int = 6):
        self.records: list[tuple[float, int, int | None]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()

        def run() -> None:
            while not self._stop.is_set():
                sent = time.monotonic()
                status, start = _send(router_url, min_version)
                with self._lock:
                    self.records.append((sent, status, start))

        self._threads = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[tuple[float, int, int | None]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        return list(self.records)


def test_a_version_the_updater_announces_is_routed_on_by_both_processes_once_the_call_returns(setup) -> None:
    sim, router, client = setup
    target = sim.urls[0]
    before = _requests_per_process(router.url)
    hammer = Hammer(router.url, min_version=1)
    time.sleep(1.0)  # nothing serves version 1 yet: 409s, retryable
    client.set_worker_state(target, "paused")
    _activate(target, 1)
    client.set_worker_state(target, "ready")  # the router reads the engine's version before it answers
    announced = time.monotonic()
    time.sleep(2.0)
    records = hammer.stop()
    served = [(sent, start) for sent, status, start in records if status == 200]
    assert served and all(start >= 1 for _, start in served)  # never an older version than asked for
    after = [status for sent, status, _ in records if sent > announced]
    assert len(after) > 20 and set(after) == {200}, after  # no 409 from either process once it was announced
    assert {status for _, status, _ in records} <= {200, 409}
    assert all(now > then for now, then in zip(_requests_per_process(router.url), before))  # both processes served


def test_a_version_one_process_learns_from_an_answer_is_routed_on_by_both_alike(setup) -> None:
    sim, router, client = setup
    target = sim.urls[1]
    _activate(target, 2)  # behind the router's back: it learns it from the engine's answers (or a probe)
    deadline = time.monotonic() + 60
    while (status := _send(router.url, 2))[0] != 200:
        assert status == (409, None) and time.monotonic() < deadline, status  # refused, never served older
        httpx.post(router.url + "/generate", json=BODY, timeout=30)  # unconstrained traffic carries the news
    later = [_send(router.url, 2) for _ in range(40)]
    assert all(status == 200 and start >= 2 for status, start in later), later
    assert client.worker(target)["weight_version"] == 2


def test_the_registry_and_its_totals_answer_the_same_on_every_connection(setup) -> None:
    sim, router, client = setup
    keys = ApiKeys(admin_api_key=ADMIN_KEY)
    added = httpx.post(router.url + "/add_worker", json={"url": sim.urls[2]}, headers=keys.headers_for("/add_worker"))
    assert added.status_code == 200  # already registered: unchanged, whichever process took the call
    for _ in range(10):
        answer = httpx.get(router.url + "/list_workers")
        assert answer.status_code == 200 and sorted(answer.json()["urls"]) == sorted(sim.urls)
        assert httpx.post(router.url + "/add_worker", json={"url": "x"}).status_code == 401  # the guard, everywhere
    before = sum(w["num_served"] for w in client.list_workers())
    for _ in range(20):
        assert httpx.post(router.url + "/generate", json=BODY, timeout=30).status_code == 200
    assert sum(w["num_served"] for w in client.list_workers()) - before == 20  # every process's answers counted


def test_a_follower_that_dies_is_started_again_and_a_killed_leader_takes_its_followers_along(setup, tmp_path) -> None:
    import os
    import signal

    from miles_disagg.bench.processes import process_tree

    sim, _, _ = setup
    router = launch_router(log_path=tmp_path / "router.log", workers=sim.urls, extra_args=["--router-workers", "2"])
    try:
        _wait(lambda: httpx.get(router.url + "/health").json()["router_workers"]["serving"] == 2, "both serving")
        follower = process_tree(router.proc.pid)[1]
        os.kill(follower, signal.SIGKILL)
        _wait(lambda: len(process_tree(router.proc.pid)) == 2 and process_tree(router.proc.pid)[1] != follower,
              "a new follower")
        _wait(lambda: httpx.get(router.url + "/health").json()["router_workers"]["serving"] == 2, "both serving again")
        assert all(_send(router.url, 0)[0] == 200 for _ in range(20))
        replacement = process_tree(router.proc.pid)[1]
        os.kill(router.proc.pid, signal.SIGKILL)
        _wait(lambda: not os.path.exists(f"/proc/{replacement}") or _zombie(replacement), "the follower to exit")
    finally:
        router.stop()


def _zombie(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_both_processes_keep_a_session_on_one_engine(setup) -> None:
    """Session affinity across the processes: whichever one a turn's connection lands on routes it to the
    engine that served the session's previous turn (the key lives in their shared table)."""
    _, router, _ = setup
    before = _requests_per_process(router.url)
    served = {httpx.post(router.url + "/generate", json=BODY, headers={"X-SMG-Routing-Key": "one-session"},
                         timeout=30).json()["meta_info"]["routed_worker"] for _ in range(40)}
    assert len(served) == 1, served
    assert all(now > then for now, then in zip(_requests_per_process(router.url), before))  # both routed turns
    assert httpx.get(router.url + "/metrics").json()["session_affinity_hits"] >= 39
