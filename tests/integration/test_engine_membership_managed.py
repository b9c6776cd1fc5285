"""``miles-disagg engines add --managed N`` and the removal of a managed engine, on a private Ray.

The run (an ``EngineManager`` in this process, the Ray driver) attached one built-in engine; the Ray
cluster has one more logical GPU free. ``--managed 2`` is refused (one GPU free, nothing started);
``--managed 1`` starts a built-in engine on it (its own placement group), brings it to the current
version and routes to it; later updates cover it; ``remove`` stops it and frees its GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from engine_fixtures import start_engine, stop_engine, wait_until
from rollout_fixtures import VersionSource, ray_session

from miles_disagg.cli import main
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.fleet.manager import EngineManager
from miles_disagg.router.client import RouterClient


def engines(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["engines", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_managed_engines_join_on_free_gpus_and_are_stopped_when_removed(tiny_qwen3_dir: Path, tmp_path: Path,
                                                                        capsys) -> None:
    import ray

    store, run_dir = tmp_path / "store", tmp_path / "run"
    attached = start_engine(tiny_qwen3_dir, tmp_path, "--weight-store-dir", str(store),
                            "--local-checkpoint-dir", str(tmp_path / "local-attached"))
    try:
        with ray_session(num_gpus=1):
            manager = EngineManager(EngineManagerConfig(
                cluster=ClusterConfig(actor_num_gpus_per_node=1),
                rollout=RolloutConfig(rollout_external=True, rollout_backend="builtin",
                                      rollout_external_engine_addrs=[attached.url.removeprefix("http://")]),
                weights=WeightUpdateConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(store)),
                model_path=str(tiny_qwen3_dir), run_dir=str(run_dir)))
            versions = None
            try:
                info = manager.start()
                manager.serve_membership()
                versions = VersionSource(store, tiny_qwen3_dir)
                manager.update_weights(versions.publish_next(seed=1))

                code, out, err = engines(capsys, "add", "--run-dir", str(run_dir), "--managed", "2")
                assert code == 2 and "1 GPU(s) free" in err and "nothing was started" in err
                assert ray.available_resources().get("GPU") == 1

                code, out, err = engines(capsys, "add", "--run-dir", str(run_dir), "--managed", "1", "--json")
                assert code == 0, err
                [joined] = json.loads(out)["joined"]
                assert (joined["kind"], joined["version"]) == ("managed", 1)
                assert ray.available_resources().get("GPU", 0) == 0
                with RouterClient(info["router_url"]) as router:
                    assert sorted((w["url"], w["weight_version"]) for w in router.list_workers()) == sorted(
                        [(attached.url, 1), (joined["url"], 1)])
                manager.update_weights(versions.publish_next(seed=2))
                assert manager.versions() == ["2", "2"]
                code, out, _ = engines(capsys, "list", "--run-dir", str(run_dir), "--json")
                listed = {e["url"]: e for e in json.loads(out)["engines"]}
                assert listed[joined["url"]]["kind"] == "managed" and listed[joined["url"]]["node"]

                code, out, err = engines(capsys, "remove", "--run-dir", str(run_dir), "--json", joined["url"])
                assert code == 0, err
                assert json.loads(out)["removed"][0]["kind"] == "managed"
                try:
                    httpx.get(f"{joined['url']}/health", timeout=5, trust_env=False)
                    raise AssertionError("a removed managed engine is stopped")
                except httpx.TransportError:
                    pass
                wait_until(lambda: ray.available_resources().get("GPU") == 1, timeout=30,
                           what="the removed engine's placement group freeing its GPU")
                assert manager.versions() == ["2"]
            finally:
                if versions is not None:
                    versions.close()
                manager.shutdown()
    finally:
        stop_engine(attached)
