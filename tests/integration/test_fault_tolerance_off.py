"""Without ``--use-fault-tolerance`` (miles' default) a managed engine that dies is taken out of
the router and not restarted, and the next weight update fails the run with one line naming it
(the restart path with the flag is covered by ``test_rollout_managed.py``)."""

from __future__ import annotations

import pytest

from engine_fixtures import wait_until
from rollout_fixtures import RecordingManager, VersionSource, ray_session
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.router.client import RouterClient
from miles_disagg.trainer.placement import create_placement, plan_layout
from miles_disagg.types import EngineUnrecoverable

pytestmark = pytest.mark.timeout(240)


def test_a_dead_engine_without_fault_tolerance_fails_the_next_update(tiny_qwen3_dir, tmp_path) -> None:
    import ray

    cluster = ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=1)
    rollout = RolloutConfig(rollout_backend="builtin", rollout_health_check_interval=0.2,
                            rollout_health_check_timeout=5.0)
    assert rollout.use_fault_tolerance is False
    weights = WeightUpdateConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(tmp_path / "s"))
    with ray_session(num_gpus=2):
        placement = create_placement(plan_layout(cluster))
        config = EngineManagerConfig(cluster=cluster, rollout=rollout, weights=weights, model_path=str(tiny_qwen3_dir),
                                     run_dir=str(tmp_path / "run"))
        manager = ray.remote(RecordingManager).options(num_cpus=0, max_concurrency=8).remote(config, placement=placement)
        versions = VersionSource(tmp_path / "s", tiny_qwen3_dir)
        try:
            info = ray.get(manager.start.remote(), timeout=180)
            assert info["delta_filters"] == [["byteplane", "none"]]  # the built-in engine announces its formats
            url = info["engine_urls"][0]
            assert ray.get(manager.kill_engine.remote(0))

            def lost() -> bool:
                return any(e["event"] == "lost" for e in ray.get(manager.info.remote())["events"])

            wait_until(lost, timeout=60, what="the monitor records the lost engine")
            with RouterClient(info["router_url"]) as router:
                assert url not in {w["url"] for w in router.list_workers()}
            version = versions.publish_next(seed=1)
            with pytest.raises(EngineUnrecoverable, match="--use-fault-tolerance is off"):
                ray.get(manager.update_weights.remote(version), timeout=120)
            assert ray.get(manager.info.remote())["engine_urls"] == [url]  # not restarted
        finally:
            versions.close()
            ray.get(manager.shutdown.remote(), timeout=60)
