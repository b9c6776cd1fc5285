"""What the run does not take on trust, through real servers on 127.0.0.1 (issue 38 item 1).

* Two routers that list each other as workers: one ``/generate`` ends after a bounded number of
  hops with one 508 (Loop Detected), not thousands of bounces.
* A metrics read never ends a run: the engine busy-fraction meter against a router that answers
  ``/list_workers`` too slowly gives no reading (logged), then readings again once it answers.
* An address named at start that is not an engine of this job (``{}`` to everything) is refused
  before the router sees it, and no key of the run reaches it.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
import recording_server as recording
from router_fixtures import generate_body, inprocess_router

from miles_disagg.router.hops import HOPS_HEADER, LOOP_DETECTED, MAX_HOPS


def test_two_routers_listing_each_other_end_a_request_after_a_bounded_number_of_hops():
    with inprocess_router() as first, inprocess_router() as second:
        first.client.add_worker(second.url)
        second.client.add_worker(first.url)
        answer = first.generate(generate_body())
        assert answer.status_code == LOOP_DETECTED, answer.text
        assert answer.json()["type"] == "RouterLoop" and "routing loop" in answer.json()["message"]
        proxied = first.client.metrics()["requests"] + second.client.metrics()["requests"]
        assert proxied <= MAX_HOPS + 1, proxied  # each router took it at most once per hop

        refused = first.generate(generate_body(), headers={HOPS_HEADER: str(MAX_HOPS)})
        assert refused.status_code == LOOP_DETECTED
        assert (refused.json()["type"], refused.json()["hops"]) == ("RouterLoop", MAX_HOPS)
        malformed = first.generate(generate_body(), headers={HOPS_HEADER: "many"})
        assert malformed.status_code == 400 and HOPS_HEADER in malformed.json()["message"]


def test_a_slow_list_workers_read_gives_no_reading_and_never_ends_the_run(caplog):
    from miles_disagg.loop.records import BusyMeter

    state = {"slow": True, "busy_s": 0.0}

    def answer(path: str):
        if path != "/list_workers":
            return 404, {}
        state["busy_s"] += 0.5
        return 200, {"workers": [{"url": "http://e:1", "busy_s": state["busy_s"]}]}

    with recording.recording_server(answer, hang_s=2.0) as router:
        meter = BusyMeter(router.url, timeout_s=0.5)  # the start reading times out (ReadTimeout)
        assert meter.fraction() is None  # and so does this one: logged, no reading, no exception
        assert "no reading from" in caplog.text and "ReadTimeout" in caplog.text
        router.hang_s = 0.0
        assert meter.fraction() is None  # the first good reading: measured from here
        time.sleep(0.2)
        fraction = meter.fraction()
        assert fraction is not None and 0.0 <= fraction <= 1.0
        router.answer = lambda path: (200, ["not", "an", "object"])
        assert meter.fraction() is None


@pytest.mark.timeout(180)
def test_an_address_answering_empty_objects_is_refused_at_start_and_gets_no_key(tiny_qwen3_dir, tmp_path,
                                                                                monkeypatch):
    from miles_disagg.config.actors import EngineManagerConfig
    from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
    from miles_disagg.fleet.manager import EngineManager
    from miles_disagg.net.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, new_key
    from miles_disagg.types import ConfigError

    monkeypatch.setenv(ADMIN_API_KEY_ENV, new_key())
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with recording.recording_server(recording.empty_objects) as server:
        manager = EngineManager(EngineManagerConfig(
            cluster=ClusterConfig(actor_num_gpus_per_node=1),
            rollout=RolloutConfig(rollout_external=True, rollout_external_engine_addrs=[server.url[len("http://"):]]),
            weights=WeightUpdateConfig(update_weight_transfer_mode="disk-delta",
                                       update_weight_disk_dir=str(tmp_path / "store")),
            model_path=str(tiny_qwen3_dir), run_dir=str(tmp_path / "run")))
        try:
            with pytest.raises(ConfigError, match="does not match this job: architectures") as refused:
                manager.start()
        finally:
            manager.shutdown()
        assert "weight store: the engine does not say" in str(refused.value)
        assert server.requests and server.authorizations == [], server.requests
        assert os.environ[ADMIN_API_KEY_ENV] not in str(refused.value)


def test_the_agent_says_which_stores_it_pulls_from(tmp_path):
    """An agent in front of stock SGLang names its stores in /agent_info (absent means refused)."""
    from miles_disagg.engines.launch import launch_agent

    with recording.recording_server(recording.empty_objects) as engine:
        agent = launch_agent(engine.url, tmp_path / "local", log_path=tmp_path / "agent.log",
                             store_dirs=[tmp_path / "store"])
        try:
            info = httpx.get(f"{agent.url}/agent_info", trust_env=False).json()
        finally:
            agent.stop()
    assert info["weight_store_dirs"] == [str(tmp_path / "store")]


def test_only_the_api_key_and_only_by_the_flag_reaches_an_address_answering_401(monkeypatch):
    """``--rollout-api-key-before-vetting`` (``api_key_before_vetting``): the info reads are asked again
    with the API key, never the admin key; without it the 401 is the refusal and no key is sent."""
    from miles_disagg.fleet.vetting import WANTS_KEY, WantsKey, read_info
    from miles_disagg.net.auth import ApiKeys

    keys = ApiKeys(api_key="the-api-key", admin_api_key="the-admin-key")
    with recording.recording_server(recording.key_wanted) as server:
        with pytest.raises(WantsKey, match="wants a key before it has shown it is an engine"):
            read_info(server.url, keys)
        assert server.authorizations == [] and str(WantsKey(WANTS_KEY)).count("\n") == 0
        with pytest.raises(Exception, match="/server_info answered 401"):
            read_info(server.url, keys, api_key_before_vetting=True)
        assert set(server.authorizations) == {"Bearer the-api-key"}, server.requests
