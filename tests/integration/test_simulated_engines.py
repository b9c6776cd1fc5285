"""Simulated engines (``miles-disagg sim-engines``) through real HTTP: the run's updater brings them to a
version, the real router routes to them by version, keys and wrong types are refused, a pause in
``abort`` mode aborts what is in flight; and ``miles-disagg bench scale`` prints its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from deadlines import scaled

from miles_disagg.net.auth import ADMIN_API_KEY_ENV
from miles_disagg.bench.processes import SimFleetProcess, start_router, wait_router_ready
from miles_disagg.bench.scale import ScaleBench
from miles_disagg.engines.activation import ActivationFailed
from miles_disagg.engines.updater import DiskDeltaUpdater

pytestmark = pytest.mark.timeout(300)
ADMIN_KEY = "sim-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
GENERATE = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 5}, "return_logprob": True}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sim")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ADMIN_API_KEY_ENV, ADMIN_KEY)
        sim = SimFleetProcess.start(root / "sim.log", 3, ScaleBench(per_request_ms=50, pull_ms=20, load_ms=10))
        yield root, sim
        sim.stop()


def test_the_updater_brings_every_engine_to_the_version_and_the_router_routes_by_it(fleet, monkeypatch) -> None:
    root, sim = fleet
    monkeypatch.setenv(ADMIN_API_KEY_ENV, ADMIN_KEY)
    updater = DiskDeltaUpdater(sim.urls, store_dir=str(root / "store"),
                               local_dirs=[str(root / f"local-{i}") for i in range(3)])
    try:
        report = updater.update(1)
    finally:
        updater.close()
    assert len(report.per_engine_pause_s) == 3 and report.prepare_time_s > 0
    assert [httpx.get(u + "/model_info").json()["weight_version"] for u in sim.urls] == ["1", "1", "1"]
    router = start_router(root, sim.urls, 3)
    try:
        wait_router_ready(router.url, 3)
        answer = httpx.post(router.url + "/generate", json={**GENERATE, "weight_version": {"min_version": 1}},
                            timeout=30)
        assert answer.status_code == 200, answer.text
        meta = answer.json()["meta_info"]
        assert (meta["weight_version_start"], meta["weight_version_end"]) == (1, 1)
        assert len(meta["output_token_logprobs"]) == 5 and meta["routed_worker"] in sim.urls
        refused = httpx.post(router.url + "/generate", json={**GENERATE, "weight_version": {"min_version": 2}},
                             timeout=30)
        assert refused.status_code == 409 and refused.json()["type"] == "WeightVersionNotReady"
        overhead = httpx.get(router.url + "/metrics").json()["routing_overhead_ms"]
        assert overhead["count"] >= 1 and overhead["p99"] >= overhead["p50"] >= 0
    finally:
        router.stop()


def test_engines_without_one_call_take_the_steps_at_most_so_many_paused_at_once(tmp_path, monkeypatch) -> None:
    """Simulated engines answering as stock SGLang (``--stock-activation``: no ``/activate_weights``, none
    announced): the updater takes the per-step path, every engine reaches the version, and never more than
    :data:`~miles_disagg.engines.updater.MAX_STEPPING_AT_ONCE` of them are out of the router at once."""
    from miles_disagg.engines import updater as updater_module

    monkeypatch.setenv(ADMIN_API_KEY_ENV, ADMIN_KEY)
    monkeypatch.setattr(updater_module, "MAX_STEPPING_AT_ONCE", 2)
    stock = SimFleetProcess.start(tmp_path / "sim.log", 5, ScaleBench(per_request_ms=5, pull_ms=10, load_ms=20),
                                  stock_activation=True)
    events: list[tuple[str, str]] = []
    try:
        assert httpx.post(stock.urls[0] + "/activate_weights", json={}, headers=ADMIN).status_code == 404
        updater = DiskDeltaUpdater(stock.urls, store_dir=str(tmp_path / "store"),
                                   local_dirs=[str(tmp_path / f"local-{i}") for i in range(5)],
                                   set_state=lambda url, state: events.append((url, state)))
        try:
            report = updater.update(1)
        finally:
            updater.close()
        assert [httpx.get(u + "/model_info").json()["weight_version"] for u in stock.urls] == ["1"] * 5
    finally:
        stock.stop()
    assert len(report.per_engine_pause_s) == 5 and min(report.per_engine_pause_s) >= 0.02  # the load, timed here
    out, most = 0, 0
    for _url, state in events:
        out += 1 if state == "paused" else -1
        most = max(most, out)
    assert most == 2 and out == 0 and len(events) == 10, events


def test_an_unstaged_version_fails_the_activation_and_the_engine_is_not_left_paused(fleet, monkeypatch) -> None:
    root, sim = fleet
    monkeypatch.setenv(ADMIN_API_KEY_ENV, ADMIN_KEY)
    updater = DiskDeltaUpdater(sim.urls[:1], store_dir=str(root / "store"), local_dirs=[str(root / "local-0")])
    try:
        with pytest.raises(ActivationFailed, match="version 7 was not staged"):
            updater.activate(0, 7)  # never pulled
    finally:
        updater.close()
    assert httpx.post(sim.urls[0] + "/generate", json=GENERATE, timeout=30).status_code == 200  # continued


def test_keys_and_wrong_types_are_refused(fleet) -> None:
    _, sim = fleet
    url = sim.urls[2]
    assert httpx.post(url + "/pause_generation", json={"mode": "retract"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200
    bad_version = httpx.post(url + "/pull_weights", headers=ADMIN,
                             json={"target_version": "3", "source_dir": "/s", "local_checkpoint_dir": "/l"})
    assert bad_version.status_code == 400 and "target_version" in bad_version.json()["message"]
    nul = httpx.post(url + "/pull_weights", headers=ADMIN,
                     json={"target_version": 3, "source_dir": "/s\x00x", "local_checkpoint_dir": "/l"})
    assert nul.status_code == 400 and "NUL" in nul.json()["message"]
    assert httpx.post(url + "/generate", json={"input_ids": [1], "sampling_params": {"max_new_tokens": "9"}}
                      ).status_code == 400
    assert httpx.post(url + "/generate", content=b"[1, 2]").status_code == 400


def test_a_pause_in_abort_mode_aborts_requests_in_flight(fleet) -> None:
    _, sim = fleet
    url = sim.urls[1]
    answers: list[dict] = []
    slow = {**GENERATE, "sampling_params": {"max_new_tokens": 3}}
    assert httpx.post(url + "/pause_generation", json={"mode": "retract"}, headers=ADMIN).status_code == 200
    thread = threading.Thread(target=lambda: answers.append(httpx.post(url + "/generate", json=slow,
                                                                       timeout=30).json()))
    thread.start()  # the request waits: the engine is paused
    import time

    deadline = time.monotonic() + 30
    while httpx.get(url + "/server_info").json()["internal_states"][0]["num_running_requests"] == 0:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.01)
    assert httpx.post(url + "/pause_generation", json={"mode": "abort"}, headers=ADMIN).status_code == 200
    assert httpx.post(url + "/continue_generation", json={}, headers=ADMIN).status_code == 200
    thread.join(30)
    assert answers and answers[0]["meta_info"]["finish_reason"]["type"] == "abort"
    assert answers[0]["output_ids"] == []


def test_bench_scale_prints_one_json_object_with_every_pool_size(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "miles_disagg.cli", "bench", "scale", "--engines", "2,4", "--updates", "1",
         "--in-flight", "16", "--rollout-concurrency", "16", "--duration", "0.5", "--rounds", "2",
         "--router-workers", "1,2", "--sim-processes", "2", "--idle-measure", "0.5", "--json",
         "--work-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=scaled(420))
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout)
    assert sorted(out["pools"]) == ["2", "4"]
    for pool in out["pools"].values():
        assert pool["fanout"]["update_s"] > 0 and pool["fanout"]["threads"]["update_s"] > 0 and pool["router"]["served"] > 0 and pool["router"]["errors"] == {}
        assert pool["router"]["router_rss_mb"]["peak"] > 0 and len(pool["router"]["windows"]) == 2
        assert set(pool["router"]["cpu_cores"]) == {"router", "router_busiest_process", "sim_engines",
                                                    "sim_engines_busiest_process", "load_client"}
        two = pool["router_by_workers"]["2"]  # two router processes on one port: both measured
        assert two["router_workers"] == 2 and two["served"] > 0 and two["errors"] == {}
        assert len(two["router_processes_rss_mb"]) == 2 and two["routing_overhead_ms"]["count"] > 0
        assert len(pool["sim_engines_rss_mb"]) == 2  # the simulated engines in two processes
        assert pool["fanout"]["sim_engines_cpu_s"] >= 0 and len(pool["router"]["throughput_vs_smallest_per_round"]) == 2
        per_step = pool["fanout_per_step"]  # engines without one-call activation, measured the same way
        assert per_step["update_s"] > 0 and per_step["max_pause_s"] > 0 and per_step["threads"] is None
        assert pool["rollout"]["samples_per_s"] > 0 and pool["rollout"]["rollout_concurrency"] == 16
        assert len(pool["rollout"]["samples_per_s_per_round"]) == 2 and pool["router"]["router_net_cpu_ms_per_request"] >= 0
    assert {"fanout_update_time_vs_smallest", "fanout_per_step_max_pause_vs_smallest", "router_throughput_vs_smallest",
            "router_throughput_vs_smallest_median_of_rounds", "rollout_samples_per_s_vs_smallest_median_of_rounds",
            "rollout_samples_per_s_vs_smallest"} <= set(out["ratios"]["4_vs_2"])
    assert out["settings"]["rounds"] == 2
    assert out["ratios"]["fanout_loop_vs_threads_4"]["updater_cpu"] > 0
    assert set(out["ratios"]["4_vs_2"]["router_throughput_vs_smallest_by_workers"]) == {"1", "2"}
    assert out["ratios"]["router_workers_4"]["2_vs_1"]["throughput"] > 0


def test_a_batched_generate_answers_one_item_per_prompt(fleet) -> None:
    _, sim = fleet
    answer = httpx.post(sim.urls[0] + "/generate", json={"input_ids": [[1, 2], [3]], "sampling_params":
                                                         {"max_new_tokens": 2}}, timeout=30).json()
    assert [item["meta_info"]["prompt_tokens"] for item in answer] == [2, 1]
    refused = httpx.post(sim.urls[0] + "/generate", json={**GENERATE, "weight_version": {"min_version": 0}})
    assert refused.status_code == 400 and "router" in refused.text
