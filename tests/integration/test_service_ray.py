"""Replicas as Ray actors (a private local Ray, as a rollout cluster separate from any trainer's),
scaled by the gateway's load: up under load, a publication converges on both, down while
requests are in flight, and no request is lost on the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_fixtures import wait_until
from rollout_fixtures import ray_session
from service_fixtures import ConstrainedLoad, Publisher, check_answers
from miles_disagg.service.client import GatewayClient
from miles_disagg.service.launch import ReplicaOptions, launch_gateway
from miles_disagg.service.ray_pool import RayReplicaPool, RayServiceConfig
from miles_disagg.service.scaling import ScalingConfig

pytestmark = pytest.mark.timeout(240)


def test_ray_pool_follows_the_gateway_load_while_versions_converge(tiny_qwen3_dir: Path, tmp_path: Path):
    publisher = Publisher(tmp_path / "store", tiny_qwen3_dir)
    scaling = ScalingConfig(min_replicas=1, max_replicas=2, target_in_flight_per_replica=2, tolerance=0.0,
                            scale_down_delay_s=0.0)
    config = RayServiceConfig(store_dir=tmp_path / "store", base_dir=tiny_qwen3_dir, work_dir=tmp_path / "work",
                              scaling=scaling, replica=ReplicaOptions(poll_interval_s=0.3, heartbeat_interval_s=0.3),
                              num_cpus_per_replica=1)
    gateway = launch_gateway(log_path=tmp_path / "gateway.log", heartbeat_timeout_s=2.0, retry_after_s=0.2)
    client = GatewayClient(gateway.url)
    answers = []
    try:
        with ray_session(num_gpus=0):
            pool = RayReplicaPool(config, gateway.url)
            try:
                assert pool.autoscale_once(client) == 1  # the minimum, with no load at all
                client.wait_converged(0, num_replicas=1, timeout_s=120)
                busy = ConstrainedLoad(gateway.url, 4, lambda: {"min_version": publisher.latest}, max_new_tokens=64)
                try:
                    wait_until(lambda: client.metrics()["load"]["in_flight"] >= 3, timeout=60, what="load in flight")
                    # in-flight counts move request by request: decide until a decision sees the load
                    wait_until(lambda: pool.autoscale_once(client) == 2, timeout=60, what="scale up to two")
                    version = publisher.publish()
                    client.wait_converged(version, num_replicas=2, timeout_s=120)
                finally:
                    answers += busy.stop()
                light = ConstrainedLoad(gateway.url, 1, lambda: {"min_version": publisher.latest}, max_new_tokens=64)
                try:
                    wait_until(lambda: light.count() >= 2, timeout=60, what="light load")
                    # refusals counted while both replicas activated can ask for capacity once more;
                    # under steady light load the next decisions come down to one (draining under load)
                    wait_until(lambda: pool.autoscale_once(client) == 1, timeout=60, what="scale down to one")
                    wait_until(lambda: light.count() >= 4, timeout=60, what="light load after scaling down")
                finally:
                    answers += light.stop()
                assert [r["replica_id"] for r in client.replicas()] == ["ray-0"]
            finally:
                pool.stop()
    finally:
        client.close()
        gateway.stop()
        publisher.close()
    counts = check_answers(answers)
    assert counts.get("200", 0) >= 4 and "502" not in counts, counts
