"""The rollout service on one machine: a gateway, two replica processes with built-in engines,
a version store that a publisher in this process writes to.

The service is shared by the module (versions only move forward; each test works from the
store's newest version). Replicas poll the store every 0.3 s; no test calls ``/wake`` unless
it says so, so every convergence here also shows that publishing alone reaches the replicas.
Races (a replica killed while it stages or activates, a late replica held while it catches
up) are driven with the gate files of ``service_fixtures``, never with sleeps.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine_fixtures import Background, wait_until
from rollout_fixtures import running_requests
from service_fixtures import (ConstrainedLoad, Gates, Publisher, body, check_answers, greedy_by_engine, hook_env,
                              post, replica_entry, replica_of_pid, serve_until_ok)
from miles_disagg.service.launch import ReplicaOptions
from miles_disagg.service.local import launch_local_service

pytestmark = pytest.mark.timeout(180)

CONVERGE_S = 90.0
LONG_TOKENS = 2000


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("service")
    gates = Gates(root / "gates")
    publisher = Publisher(root / "store", tiny_qwen3_dir)
    options = ReplicaOptions(poll_interval_s=0.3, heartbeat_interval_s=0.3, pre_read_hook="service_fixtures:hold_pull",
                             phase_hook="service_fixtures:hold_phase", env=hook_env(gates), drain_timeout_s=30)
    service = launch_local_service(root / "store", tiny_qwen3_dir, work_dir=root / "work", num_replicas=2,
                                   replica=options, heartbeat_timeout_s=2.0, retry_after_s=0.2, wait_ready_s=120)
    client = service.client()
    try:
        yield service, client, publisher, gates
    finally:
        gates.release_all()
        client.close()
        service.stop()
        publisher.close()


@pytest.fixture(autouse=True)
def clean_gates(world):
    world[3].release_all()
    yield
    world[3].release_all()


def constraint_with_staleness(publisher: Publisher, staleness: int = 1):
    return lambda: {"min_version": max(0, publisher.latest - staleness)}


def test_exact_future_version_is_refused_retryably_until_published_then_served(world):
    service, client, publisher, _ = world
    future = publisher.latest + 1
    with httpx.Client(timeout=60, trust_env=False) as http:
        status, answer, headers = post(http, service.url, body(weight_version={"exact_version": future}))
    assert status == 409, answer
    assert answer["type"] == "WeightVersionNotReady" and answer["retryable"] is True
    assert answer["available_versions"] == [future - 1] and int(headers["retry-after"]) >= 1
    assert publisher.publish() == future
    served, _ = serve_until_ok(service.url, body(weight_version={"exact_version": future}), timeout_s=CONVERGE_S)
    meta = served["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"]) == (future, future)


def test_a_min_version_request_is_served_only_by_a_converged_replica(world):
    service, client, publisher, gates = world
    client.wait_converged(publisher.latest, num_replicas=2, timeout_s=CONVERGE_S)
    gates.hold("pull")
    version = publisher.publish()
    held = gates.wait_held("pull", 2)  # both engines stage v and are held there
    slow_pid = max(held)
    gates.hold("pull", slow_pid)  # keep one held ...
    gates.release("pull")  # ... and let the other converge
    slow = replica_entry(client, replica_of_pid(service, slow_pid))
    client.wait_for(lambda rs: any(r["state"] == "ready" and r["weight_version"] == version for r in rs),
                    CONVERGE_S, f"one replica ready at v{version}")
    routed = set()
    with httpx.Client(timeout=60, trust_env=False) as http:
        for i in range(6):
            status, answer, _ = post(http, service.url, body(seed=i, weight_version={"min_version": version}))
            assert status == 200, answer
            assert answer["meta_info"]["weight_version_start"] >= version
            routed.add(answer["meta_info"]["routed_worker"])
        status, answer, _ = post(http, service.url, body(weight_version={"min_version": version - 1}))
        assert status == 200  # an older bound is served by either replica
    assert slow["engine_url"] not in routed and len(routed) == 1
    assert replica_entry(client, slow["replica_id"])["weight_version"] == version - 1  # still serving, not advertising v
    gates.release("pull", slow_pid)
    client.wait_converged(version, num_replicas=2, timeout_s=CONVERGE_S)


def test_bounded_load_across_publications_keeps_every_constraint_and_loses_nothing(world):
    service, client, publisher, _ = world
    client.wait_converged(publisher.latest, num_replicas=2, timeout_s=CONVERGE_S)
    exact = ConstrainedLoad(service.url, 2, lambda: {"exact_version": publisher.latest}, max_new_tokens=24)
    bounded = ConstrainedLoad(service.url, 2, constraint_with_staleness(publisher), max_new_tokens=24)
    try:
        for _ in range(3):
            count = bounded.count()
            wait_until(lambda: bounded.count() >= count + 2, timeout=60, what="requests across the publication")
            version = publisher.publish()
            client.wait_converged(version, num_replicas=2, timeout_s=CONVERGE_S)
    finally:
        answers = exact.stop() + bounded.stop()
    counts = check_answers(answers)
    assert counts.get("200", 0) >= 6, counts
    assert any(a.status == 200 and "exact_version" in a.constraint for a in answers)
    metrics = client.metrics()
    assert metrics["requests"]["counts"].get("samples_violating_constraint", 0) == 0
    for replica in metrics["replicas"]:
        assert replica["pause_s"]["count"] >= 3 and replica["prepare_s"]["count"] >= 3
    converged = metrics["convergence"]["versions"][str(publisher.latest)]["converged_s"]
    assert converged["1"] is not None and converged["0.5"] <= converged["1"]


def test_a_request_in_flight_across_an_activation_is_answered_with_both_versions(world):
    service, client, publisher, _ = world
    version = publisher.latest
    client.wait_converged(version, num_replicas=2, timeout_s=CONVERGE_S)
    engines = [r["engine_url"] for r in client.replicas()]
    with httpx.Client(timeout=120, trust_env=False) as http:
        # ~2 s of decoding on the tiny model; the update below takes a few hundred ms after the wake
        long = Background(lambda: post(http, service.url, body(LONG_TOKENS, weight_version={"min_version": version})))
        wait_until(lambda: sum(running_requests(url) for url in engines) == 1, timeout=30, what="the request decoding")
        newer = publisher.publish()
        client.wake()
        client.wait_converged(newer, num_replicas=2, timeout_s=CONVERGE_S)
        status, answer, _ = long.result()
    assert status == 200, answer
    meta = answer["meta_info"]
    assert (meta["weight_version_start"], meta["weight_version_end"]) == (version, newer), meta
    assert meta["completion_tokens"] == LONG_TOKENS


@pytest.mark.parametrize("phase", ["pull", "paused"], ids=["killed-while-staging", "killed-while-activating"])
def test_a_replica_killed_mid_update_never_serves_a_partial_policy_and_the_fleet_converges(world, phase):
    service, client, publisher, gates = world
    client.wait_converged(publisher.latest, num_replicas=2, timeout_s=CONVERGE_S)
    load = ConstrainedLoad(service.url, 3, constraint_with_staleness(publisher), max_new_tokens=24)
    try:
        gates.hold(phase)
        version = publisher.publish()
        held = gates.wait_held(phase, 2)  # both replicas are in the middle of the update
        victim = replica_of_pid(service, min(held))
        restarts = service.restarts(victim)
        service.kill_replica(victim)  # with its engine, mid-pull / mid-pause
        gates.release(phase)
        wait_until(lambda: service.restarts(victim) == restarts + 1, timeout=30, what="the supervisor restarting it")
        client.wait_converged(version, num_replicas=2, timeout_s=CONVERGE_S)
    finally:
        answers = load.stop()
    check_answers(answers)
    outputs = greedy_by_engine(client, version)
    assert len(outputs) == 2 and len({json.dumps(o) for o in outputs.values()}) == 1, outputs
    transitions = replica_entry(client, victim)["transitions"]
    restarted = max(i for i, t in enumerate(transitions) if t[1] == "starting")
    first_ready = next(t for t in transitions[restarted:] if t[1] == "ready")
    assert first_ready[2] == version, transitions  # the restarted replica was never routable below v


def test_a_late_replica_catches_up_through_the_chain_before_it_takes_traffic(world):
    service, client, publisher, gates = world
    version = publisher.latest
    client.wait_converged(version, num_replicas=2, timeout_s=CONVERGE_S)
    gates.hold("pull")
    late = service.add_replica()
    gates.wait_held("pull", 1)  # it seeded from the base and is staging v (held there)
    entry = client.wait_for(lambda rs: any(r["replica_id"] == late and r["engine_url"] for r in rs), 30,
                            "the late replica registered")
    late_url = next(r["engine_url"] for r in entry if r["replica_id"] == late)
    assert replica_entry(client, late)["state"] == "catching_up"
    with httpx.Client(timeout=60, trust_env=False) as http:
        for i in range(6):
            status, answer, _ = post(http, service.url, body(seed=i))
            assert status == 200 and answer["meta_info"]["routed_worker"] != late_url
    gates.release("pull")
    client.wait_converged(version, num_replicas=3, timeout_s=CONVERGE_S)
    transitions = replica_entry(client, late)["transitions"]
    assert [t[1] for t in transitions if t[1] == "ready"] and next(t for t in transitions if t[1] == "ready")[2] == version
    outputs = greedy_by_engine(client, version)
    assert len(outputs) == 3 and len({json.dumps(o) for o in outputs.values()}) == 1, outputs
    with httpx.Client(timeout=60, trust_env=False) as http:
        routed = {post(http, service.url, body(seed=i))[1]["meta_info"]["routed_worker"] for i in range(9)}
    assert late_url in routed  # ready now: it takes traffic
    load = ConstrainedLoad(service.url, 3, constraint_with_staleness(publisher, 0), max_new_tokens=24)
    try:
        wait_until(lambda: load.count() >= 3, timeout=60, what="load before the removal")
        service.remove_replica(late)  # drains while requests are in flight
    finally:
        answers = load.stop()
    counts = check_answers(answers)
    assert set(counts) <= {"200"}, counts  # a draining replica loses nothing: no 502 either
    assert late not in {r["replica_id"] for r in client.replicas()}
