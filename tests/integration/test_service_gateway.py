"""The gateway over real HTTP with fake replicas: heartbeats drive routing, silence takes a
replica out, ``/wake`` fans out, ``/service_metrics`` reports what was served.

The "engine" behind each fake replica is the router tests' fake worker (its answers are
set by the test); the heartbeats are posted by the test itself, as a replica would.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import httpx
import pytest
from fastapi import FastAPI

from engine_fixtures import wait_until
from router_fixtures import FakeWorker, fake_worker_app, generate_body, serve_in_thread
from miles_disagg.router.config import RouterConfig
from miles_disagg.service.gateway import GatewayConfig, create_gateway_app
from miles_disagg.service.protocol import Activation, ReplicaState, ReplicaStatus, StoreHead

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def gateway(**config):
    app = create_gateway_app(GatewayConfig(router=RouterConfig(health_check_interval_s=0.1, retry_after_s=0.2),
                                           expire_interval_s=0.05, **config))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30, trust_env=False) as http:
        yield http


@contextlib.contextmanager
def fake_replica(version: int):
    """A fake engine (reporting ``version``) and a control API that counts wakes."""
    fake = FakeWorker(weight_version=str(version))
    wakes: list[int] = []
    control = FastAPI()
    control.post("/wake")(lambda: wakes.append(1) or {"woken": True})
    with serve_in_thread(fake_worker_app(fake)) as engine_url, serve_in_thread(control) as control_url:
        status = ReplicaStatus(replica_id="r0", incarnation="i1", seq=0, engine_url=engine_url, control_url=control_url,
                               state=ReplicaState.CATCHING_UP, weight_version=0, run_id="run")
        yield fake, status, wakes


def beat(http: httpx.Client, status: ReplicaStatus, **changes) -> tuple[ReplicaStatus, dict]:
    status = replace(status, seq=status.seq + 1, **changes)
    response = http.post("/heartbeat", json=status.to_json())
    assert response.status_code == 200, response.text
    return status, response.json()


def test_heartbeats_decide_routing_and_a_stale_one_changes_nothing():
    with gateway() as http, fake_replica(1) as (fake, status, _):
        status, answer = beat(http, status)  # registration: catching up, not routable
        assert answer["worker"]["state"] == "paused"
        refused = http.post("/generate", json=generate_body())
        assert refused.status_code == 503 and refused.json()["retryable"] is True
        older = status
        status, _ = beat(http, status, state=ReplicaState.READY, weight_version=1, store_head=StoreHead(1, "run", 1.0),
                         activations=[Activation(1, 1.0, 2.0, 0.3, 0.01)])
        served = http.post("/generate", json=generate_body(weight_version={"min_version": 1}))
        assert served.status_code == 200 and served.json()["meta_info"]["weight_version_start"] == 1
        delayed = http.post("/heartbeat", json=older.to_json()).json()  # an old catching_up beat arrives late
        assert delayed["accepted"] is False
        assert http.post("/generate", json=generate_body()).status_code == 200
        status, answer = beat(http, status, state=ReplicaState.ACTIVATING)
        assert answer["worker"]["state"] == "activating"
        assert http.post("/generate", json=generate_body()).status_code == 503
        metrics = http.get("/service_metrics").json()
        [replica] = metrics["replicas"]
        assert replica["pause_s"]["last"] == 0.01 and replica["prepare_s"]["last"] == 0.3
        assert metrics["requests"]["counts"]["served"] == 2 and metrics["requests"]["counts"]["no_replica_available"] == 2
        assert metrics["convergence"]["versions"]["1"]["converged_s"]["1"] is not None


def test_a_silent_replica_is_taken_out_until_it_beats_again_and_deregistration_removes_it():
    with gateway(heartbeat_timeout_s=0.3, forget_after_s=30) as http, fake_replica(2) as (_, status, _):
        status, _ = beat(http, status, state=ReplicaState.READY, weight_version=2)
        assert http.post("/generate", json=generate_body()).status_code == 200
        wait_until(lambda: http.get("/replicas").json()["replicas"][0]["lost"], timeout=10, what="replica lost")
        assert http.post("/generate", json=generate_body()).status_code == 503  # nobody vouches for it
        assert http.get("/service_metrics").json()["load"]["num_replicas"] == 0
        status, _ = beat(http, status)
        assert http.post("/generate", json=generate_body()).status_code == 200
        assert http.post("/deregister", json={"replica_id": "r0"}).status_code == 200
        assert http.get("/list_workers").json()["workers"] == []
        assert http.post("/deregister", json={"replica_id": "r0"}).status_code == 400


def test_wake_fans_out_to_every_live_replica_and_malformed_heartbeats_are_refused():
    with gateway() as http, fake_replica(0) as (_, status, wakes):
        beat(http, status)
        answer = http.post("/wake").json()
        assert len(answer["woken"]) == 1 and answer["failed"] == {} and wakes == [1]
        bad = http.post("/heartbeat", json={**status.to_json(), "state": "sleeping"})
        assert bad.status_code == 400 and "state must be one of" in bad.json()["error"]["message"]
