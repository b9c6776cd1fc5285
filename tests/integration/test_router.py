"""The version-aware router over real HTTP: two built-in engines, an in-process router per test.

Engines are shared by the module (each test first resets both to version 0); the test
that kills an engine runs last. Version changes are made on the engines directly
(``/update_weight_version``), as any updater could, and the router must learn them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from deadlines import scaled

from engine_fixtures import EngineHandle, running_count, start_engine, stop_engine, wait_until
from router_fixtures import (FakeWorker, fake_worker_app, generate_body, inprocess_router, retry_until_served,
                             serve_in_thread)
from miles_disagg.engines.launch import free_port
from miles_disagg.router.client import RouterClient
from miles_disagg.router.launch import launch_router
from miles_disagg.router.registry import UnknownWorker

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def engines(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("router-engine-logs")
    # the router must learn versions changed on the engines: tests relabel them (testing-only flag)
    handles = [start_engine(tiny_qwen3_dir, log_dir, "--allow-unverified-versions") for _ in range(2)]
    yield handles
    for handle in handles:
        stop_engine(handle)


@pytest.fixture(autouse=True)
def versions_reset(engines: list[EngineHandle]):
    for engine in engines:
        if engine.proc is None or engine.proc.poll() is None:
            set_engine_version(engine, 0)


def set_engine_version(engine: EngineHandle, version: int) -> None:
    response = engine.post("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})
    assert response.status_code == 200, response.text


def assert_served_versions(item: dict, worker: str, start: int, end: int) -> None:
    meta = item["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"], meta["routed_worker"]) == (start, end, worker)


def test_ties_rotate_and_every_item_carries_served_versions(engines):
    a, b = engines
    with inprocess_router(workers=(a.url, b.url)) as router:
        assert {w["url"]: w["state"] for w in router.client.list_workers()} == {a.url: "ready", b.url: "ready"}
        routed = []
        for _ in range(4):
            response = router.generate(generate_body())
            assert response.status_code == 200, response.text
            routed.append(response.json()["meta_info"]["routed_worker"])
            assert_served_versions(response.json(), routed[-1], 0, 0)
        assert sorted(routed) == sorted([a.url, b.url] * 2)
        batch = router.generate({**generate_body(), "input_ids": [[1, 2], [3, 4], [5]]})
        assert batch.status_code == 200, batch.text
        assert len(batch.json()) == 3
        for item in batch.json():
            assert_served_versions(item, batch.headers["x-routed-worker"], 0, 0)


def test_min_version_goes_only_to_new_enough_workers(engines):
    a, b = engines
    with inprocess_router(workers=(a.url, b.url)) as router:
        set_engine_version(a, 3)
        router.client.wait_worker_version(a.url, 3)
        for constraint in ({"weight_version": {"min_version": 2}}, {}):
            headers = {} if constraint else {"X-Weight-Version-Min": "2"}
            for _ in range(3):
                response = router.generate(generate_body(**constraint), headers=headers)
                assert response.status_code == 200, response.text
                assert_served_versions(response.json(), a.url, 3, 3)
        too_new = router.generate(generate_body(weight_version={"min_version": 4}))
        assert too_new.status_code == 409
        assert too_new.headers["retry-after"] == "1"
        assert too_new.json() | {"message": None} == {
            "type": "WeightVersionNotReady", "retryable": True, "message": None, "retry_after_s": 0.2,
            "required": {"min_version": 4}, "available_versions": [0, 3]}
        malformed = router.generate(generate_body(weight_version={"min_version": 1}),
                                    headers={"X-Weight-Version-Exact": "1"})
        assert malformed.status_code == 400 and malformed.json()["retryable"] is False


def test_exact_future_version_waits_then_is_served_once_learned(engines):
    a, b = engines
    with inprocess_router(workers=(a.url, b.url)) as router:
        body = generate_body(weight_version={"exact_version": 5})
        refused = router.generate(body)
        assert refused.status_code == 409, refused.text
        assert "retry-after" in refused.headers and refused.json()["available_versions"] == [0]
        set_engine_version(b, 5)
        served = retry_until_served(router, body)
        assert served.status_code == 200, served.text
        assert_served_versions(served.json(), b.url, 5, 5)
        older = router.generate(generate_body(weight_version={"exact_version": 0}))
        assert_served_versions(older.json(), a.url, 0, 0)


def test_version_is_learned_from_responses_and_a_stale_view_is_never_served(engines):
    a, _ = engines
    with inprocess_router(workers=(a.url,), health_check_interval_s=3600.0) as router:
        set_engine_version(a, 7)  # behind the router's back; no probe will run in this test
        assert router.client.worker(a.url)["weight_version"] == 0
        stale = router.generate(generate_body(weight_version={"exact_version": 0}))
        assert stale.status_code == 409, stale.text
        assert "stale" in stale.json()["message"]
        assert router.client.worker(a.url)["weight_version"] == 7
        served = router.generate(generate_body(weight_version={"min_version": 7}))
        assert_served_versions(served.json(), a.url, 7, 7)


def test_paused_and_activating_workers_get_no_new_requests(engines):
    a, b = engines
    with inprocess_router(workers=(a.url, b.url)) as router:
        for state in ("paused", "activating"):
            assert router.client.set_worker_state(b.url, state)["state"] == state
            before = router.served()
            for _ in range(4):
                assert router.generate(generate_body()).json()["meta_info"]["routed_worker"] == a.url
            assert router.served()[b.url] == before[b.url]
        router.client.set_worker_state(a.url, "paused")
        none_ready = router.generate(generate_body())
        assert none_ready.status_code == 503 and none_ready.json()["type"] == "NoWorkerAvailable"
        assert none_ready.json()["retryable"] is True and "retry-after" in none_ready.headers
        set_engine_version(b, 2)  # "updated" while paused: ready re-reads the version at once
        ready = router.client.set_worker_state(b.url, "ready")
        assert ready | {"num_served": 0, "busy_s": 0} == {
            "url": b.url, "weight_version": 2, "run_id": None, "state": "ready", "outstanding": 0, "healthy": True,
            "last_error": None, "num_served": 0, "busy_s": 0}
        assert_served_versions(router.generate(generate_body()).json(), b.url, 2, 2)


def test_remove_and_add_workers(engines):
    a, b = engines
    with inprocess_router(workers=(a.url, b.url)) as router:
        router.client.remove_worker(b.url)
        assert [w["url"] for w in router.client.list_workers()] == [a.url]
        for _ in range(3):
            assert router.generate(generate_body()).json()["meta_info"]["routed_worker"] == a.url
        router.client.remove_worker(a.url + "/")
        assert router.generate(generate_body()).status_code == 503
        with pytest.raises(UnknownWorker):
            router.client.remove_worker(a.url)
        added = router.http.post("/add_worker", params={"url": b.url})  # sglang-router's form
        assert added.status_code == 200 and added.json()["worker"]["state"] == "ready"
        assert router.client.add_worker(a.url)["state"] == "ready"
        assert router.http.get("/list_workers").json()["urls"] == [b.url, a.url]
        assert router.generate(generate_body()).status_code == 200


def test_client_disconnect_aborts_the_engine_request(engines):
    a, _ = engines
    with inprocess_router(workers=(a.url,)) as router:
        aborted_before = a.internal_state()["num_aborted_requests"]
        payload = json.dumps(generate_body(max_new_tokens=2000)).encode()
        host, port = router.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
            wait_until(lambda: running_count(a) == 1, what="request decoding on the engine")
        wait_until(lambda: a.internal_state()["num_aborted_requests"] > aborted_before, what="upstream abort")
        wait_until(lambda: router.client.worker(a.url)["outstanding"] == 0, what="outstanding released")


def _data_lines(response) -> list[str]:
    return [line[5:].strip() for line in response.iter_lines() if line.startswith("data:")]


def test_a_streamed_generate_is_relayed_event_by_event_and_a_client_that_leaves_aborts_it(engines):
    a, _ = engines
    with inprocess_router(workers=(a.url,)) as router:
        body = generate_body(max_new_tokens=6, stream=True, weight_version={"min_version": 0})
        with httpx.stream("POST", f"{router.url}/generate", json=body, timeout=scaled(60)) as response:
            assert response.status_code == 200 and response.headers["x-routed-worker"] == a.url
            lines = _data_lines(response)
        assert lines[-1] == "[DONE]"
        events = [json.loads(line) for line in lines[:-1]]
        assert [len(e["output_ids"]) for e in events][:6] == [1, 2, 3, 4, 5, 6]  # one event per token
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"  # the last: the whole answer
        assert all(e["meta_info"]["weight_version_start"] == 0 and e["meta_info"]["routed_worker"] == a.url
                   for e in events)
        whole = router.generate(generate_body(max_new_tokens=6)).json()
        assert events[-1]["output_ids"] == whole["output_ids"]  # greedy: the same tokens as a whole answer
        assert router.client.worker(a.url)["outstanding"] == 0
        refused = router.http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1"}],
                                                                   "stream": True})
        assert refused.status_code == 400 and "stream" in refused.json()["message"]
        aborted_before = a.internal_state()["num_aborted_requests"]
        with httpx.stream("POST", f"{router.url}/generate", json=generate_body(max_new_tokens=2000, stream=True),
                          timeout=scaled(60)) as response:
            assert next(response.iter_lines()).startswith("data:")  # one event, then the client leaves
        wait_until(lambda: a.internal_state()["num_aborted_requests"] > aborted_before, what="upstream abort")
        wait_until(lambda: router.client.worker(a.url)["outstanding"] == 0, what="outstanding released")


def test_openai_routes_and_unknown_versions_via_fake_worker():
    fake = FakeWorker(weight_version="default")
    with serve_in_thread(fake_worker_app(fake)) as worker_url, inprocess_router(workers=(worker_url,)) as router:
        assert router.client.worker(worker_url) | {"num_served": 0, "busy_s": 0} == {
            "url": worker_url, "weight_version": None, "run_id": None, "state": "ready", "outstanding": 0, "healthy": True,
            "last_error": None, "num_served": 0, "busy_s": 0}
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = router.http.post(path, json={"prompt": "hi", "weight_version": None})
            assert response.status_code == 200, response.text
            assert fake.received[-1] == (path, {"prompt": "hi"})
            assert response.json()["metadata"] == {"weight_version_start": None, "weight_version_end": None,
                                                   "routed_worker": worker_url}
        refused = router.http.post("/v1/completions", json={"prompt": "hi", "weight_version": {"min_version": 0}})
        assert refused.status_code == 409 and refused.json()["available_versions"] == []
        fake.weight_version = "4"
        router.client.wait_worker_version(worker_url, 4)
        served = router.http.post("/v1/chat/completions", json={"messages": []},
                                  headers={"X-Weight-Version-Exact": "4"})
        assert served.json()["metadata"]["weight_version_start"] == 4


def test_engine_5xx_takes_the_worker_out_and_answers_retryable(engines):
    fake = FakeWorker(weight_version="1")
    with serve_in_thread(fake_worker_app(fake)) as worker_url, \
            inprocess_router(workers=(worker_url,), health_check_interval_s=3600.0) as router:
        fake.generate_status = 500
        failed = router.generate(generate_body())
        assert failed.status_code == 502, failed.text
        assert failed.json()["type"] == "WorkerFailed" and failed.json()["retryable"] is True
        assert len(fake.received) == 1, "a request that reached the worker must not be replayed"
        assert router.client.worker(worker_url)["state"] == "unhealthy"
        assert router.generate(generate_body()).status_code == 503
        fake.generate_status = 200
        router.client.set_worker_state(worker_url, "ready")  # re-probes: healthy again
        assert_served_versions(router.generate(generate_body()).json(), worker_url, 1, 1)


def test_older_version_reported_by_an_engine_without_start_end_is_refused():
    fake = FakeWorker(weight_version="3")  # SGLang-like: meta_info has weight_version only
    with serve_in_thread(fake_worker_app(fake)) as worker_url, \
            inprocess_router(workers=(worker_url,), health_check_interval_s=3600.0) as router:
        fake.weight_version = "2"  # rolled back behind the router's back
        refused = router.generate(generate_body(weight_version={"min_version": 3}))
        assert refused.status_code == 409 and "stale" in refused.json()["message"], refused.text
        router.client.set_worker_state(worker_url, "ready")  # re-probe: the router now knows 2
        assert router.generate(generate_body(weight_version={"min_version": 3})).json()["available_versions"] == [2]
        assert_served_versions(router.generate(generate_body()).json(), worker_url, 2, 2)


def test_cli_starts_serves_and_refuses_bad_input(engines, tmp_path):
    a, _ = engines
    port = free_port()
    cmd = [sys.executable, "-m", "miles_disagg.cli", "router", "--port", str(port), "--worker", a.url,
           "--health-check-interval", "0.2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline().startswith(f"miles-disagg router listening on http://127.0.0.1:{port}")
        with RouterClient(f"http://127.0.0.1:{port}") as client:
            client.wait_healthy()
            assert client.worker(a.url)["state"] == "ready"
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=generate_body(), timeout=60)
        assert_served_versions(response.json(), a.url, 0, 0)
        taken = subprocess.run([*cmd[:5], str(port)], capture_output=True, text=True, timeout=scaled(60))
        assert taken.returncode == 2 and "cannot listen" in taken.stderr
    finally:
        proc.terminate()
        proc.wait(15)
    bad = subprocess.run([*cmd[:4], "--health-check-interval", "0"], capture_output=True, text=True, timeout=scaled(60))
    assert bad.returncode == 2 and "health_check_interval_s" in bad.stderr


def test_launch_router_subprocess(engines, tmp_path):
    a, b = engines
    router = launch_router(log_path=tmp_path / "router.log", workers=[a.url, b.url], health_check_interval_s=0.2)
    try:
        with router.client() as client:
            assert [w["state"] for w in client.list_workers()] == ["ready", "ready"]
        assert "listening on" in router.logs()
    finally:
        router.stop()


def test_worker_killed_under_concurrent_load(engines):
    """Runs last: it kills the second engine."""
    a, b = engines
    with inprocess_router(workers=(a.url, b.url)) as router:
        body = generate_body(max_new_tokens=1500)
        with ThreadPoolExecutor(20) as pool:
            futures = [pool.submit(router.generate, body) for _ in range(20)]
            wait_until(lambda: running_count(a) > 0 and running_count(b) > 0, what="requests decoding on both")
            b.proc.kill()
            responses = [f.result(timeout=90) for f in futures]
        served = [r for r in responses if r.status_code == 200]
        failed = [r for r in responses if r.status_code != 200]
        assert failed, "some requests must have been in flight on the killed engine"
        for response in failed:
            assert response.status_code in (502, 503), response.text
            assert response.json()["retryable"] is True
        for response in served:
            meta = response.json()["meta_info"]
            assert meta["weight_version_start"] == meta["weight_version_end"] == 0
        assert router.client.worker(b.url)["state"] == "unhealthy"
        for _ in range(3):
            assert router.generate(generate_body()).json()["meta_info"]["routed_worker"] == a.url
