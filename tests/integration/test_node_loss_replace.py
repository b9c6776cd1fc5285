"""A lost node's engine, through the engine manager as a Ray actor (issue 30 item 2).

Ray cannot lose a node inside one local Ray, so the manager's view of the cluster is the one
thing simulated here: ``NodeLossManager`` declares engine 0's node dead (what ``ray.nodes()``
says after a machine or raylet died) while its engine still answers every health check, and
brings the node back the moment the replacement actor is created (what Ray's GCS does when a
node offers the bundle's resources again). Everything else is real: the actors, the
placement group bundle the replacement is scheduled on, the router, the version store.

Checked: the engine leaves the router within one monitor interval - long before the
health-check timeout could have taken it out; the run's capacity policy says the run would end
(``--min-rollout-engines 2``, a short timeout) while it is out; the replacement is caught up to the
current version from the store and the router lists it only at that version; no request under
continuous load is served by any other version.
"""

from __future__ import annotations

import threading
import time

import pytest

from engine_fixtures import wait_until
from rollout_fixtures import Load, RecordingManager, VersionSource, ray_session
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.fleet.replace import Replacements
from miles_disagg.router.client import RouterClient
from miles_disagg.trainer.placement import create_placement, plan_layout

pytestmark = pytest.mark.timeout(300)

HEALTH_CHECK_TIMEOUT_S = 30.0
CAPACITY_TIMEOUT_S = 0.5


class DeclaredDead(Replacements):
    """Nodes are dead when the test says so, and come back when a bundle is asked of them again."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.declared: set[str] = set()

    def _dead(self, nodes: set[str]) -> set[str]:
        return nodes & self.declared

    def _new_actor(self, index: int):
        self.declared.clear()
        return super()._new_actor(index)


class NodeLossManager(RecordingManager):
    replacements_class = DeclaredDead

    def start(self, store_probe=None) -> dict:
        info = super().start(store_probe)
        for i in self.slots.indices():  # one node each
            self.slots.set_node(i, f"{self.slots.node(i)[:40]}-engine-{i}")
        return info

    def kill_actor(self, index: int) -> None:
        """The engine's Ray actor dies (not its node): what a crashed actor worker looks like."""
        import ray

        ray.kill(self.slots.actor(index), no_restart=True)

    def declare_node_dead(self, index: int) -> str:
        node = self.slots.node(index)
        self.replacements.declared.add(node)
        return node


def test_a_lost_nodes_engine_leaves_at_once_and_returns_only_at_the_current_version(tiny_qwen3_dir, tmp_path) -> None:
    import ray

    cluster = ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, rollout_num_gpus_per_engine=1)
    rollout = RolloutConfig(rollout_backend="builtin", rollout_health_check_interval=0.2,
                            rollout_health_check_timeout=HEALTH_CHECK_TIMEOUT_S, min_rollout_engines=2,
                            min_rollout_engines_timeout=CAPACITY_TIMEOUT_S)
    assert rollout.use_fault_tolerance is False  # placing a lost node's engines again does not need it
    weights = WeightUpdateConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(tmp_path / "s"))
    with ray_session(num_gpus=3):
        placement = create_placement(plan_layout(cluster))
        config = EngineManagerConfig(cluster=cluster, rollout=rollout, weights=weights, model_path=str(tiny_qwen3_dir),
                                     run_dir=str(tmp_path / "run"))
        manager = ray.remote(NodeLossManager).options(num_cpus=0, max_concurrency=8).remote(config, placement=placement)
        versions = VersionSource(tmp_path / "s", tiny_qwen3_dir)
        try:
            info = ray.get(manager.start.remote(), timeout=180)
            for seed in (1, 2):
                ray.get(manager.update_weights.remote(versions.publish_next(seed=seed)), timeout=120)
            old_urls = info["engine_urls"]
            with RouterClient(info["router_url"]) as router:
                seen = _Sightings(router)
                load = Load(info["router_url"], concurrency=2, max_new_tokens=8)
                try:
                    node = ray.get(manager.declare_node_dead.remote(0))
                    declared = time.monotonic()
                    wait_until(lambda: old_urls[0] not in {w["url"] for w in router.list_workers()}, timeout=20,
                               what="engine 0 out of the router")
                    removed_after = time.monotonic() - declared
                    wait_until(lambda: ray.get(manager.capacity.remote())["verdict"] is not None, timeout=30,
                               what="the capacity policy to say the run would end")
                    verdict = ray.get(manager.capacity.remote())["verdict"]
                    wait_until(lambda: any(e["event"] == "restored" and e["engine"] == 0
                                           for e in ray.get(manager.info.remote())["events"]),
                               timeout=120, what="engine 0 placed again and restored")
                    new_url = ray.get(manager.info.remote())["engine_urls"][0]
                    # the router lists the replacement as ``starting`` the instant it is added, ``ready``
                    # after its first probe: the poller has to have seen it ready before it stops
                    wait_until(lambda: new_url in seen.first, timeout=30, what="the replacement listed ready")
                    wait_until(lambda: sum(a.status == 200 for a in load.answers) >= 6, timeout=60,
                               what="answers under load")
                finally:
                    answers = load.stop()
                    seen.stop()
            print(f"engine 0 left the router {removed_after:.2f}s after its node was declared dead")
            assert removed_after < HEALTH_CHECK_TIMEOUT_S / 3, removed_after
            assert verdict.startswith("only 1 of 2 rollout engine(s) served for ") and \
                f"engine 0: its node (id {node}) left the Ray cluster" in verdict, verdict
            assert ray.get(manager.capacity.remote())["verdict"] is None  # both serve again

            events = [e for e in ray.get(manager.info.remote())["events"] if e["engine"] == 0]
            assert [e["event"] for e in events] == ["down", "node_lost", "replaced", "restored"], events
            assert events[1]["node_id"] == node and events[2]["url"] == new_url != old_urls[0]
            assert events[3]["version"] == 2
            # routed to only once caught up: the first routable sighting is at the current version, and
            # no sighting is at another (the instant add_worker probes it, ``starting``, has no version yet)
            assert seen.first.get(new_url) == (2, "ready"), seen.all
            assert all(version == 2 or (version, state) == (None, "starting") for version, state in seen.all[new_url]), \
                seen.all
            assert ray.get(manager.versions.remote()) == ["2", "2"]
            served = [a for a in answers if a.status == 200]
            assert served and {(a.body["meta_info"]["weight_version_start"], a.body["meta_info"]["weight_version_end"])
                               for a in served} == {(2, 2)}

            # an actor that dies on a live node: placed again on its bundle too (not a failed run, even
            # without --use-fault-tolerance), and restored at the current version
            version = versions.publish_next(seed=3)
            ray.get(manager.update_weights.remote(version), timeout=120)
            ray.get(manager.kill_actor.remote(1))
            wait_until(lambda: [e["event"] for e in ray.get(manager.info.remote())["events"] if e["engine"] == 1][-1:]
                       == ["restored"], timeout=120, what="engine 1 placed again and restored")
            events = [e for e in ray.get(manager.info.remote())["events"] if e["engine"] == 1]
            assert [e["event"] for e in events] == ["down", "actor_lost", "replaced", "restored"], events
            assert events[-1]["version"] == version
            ray.get(manager.update_weights.remote(versions.publish_next(seed=4)), timeout=120)  # the run goes on
            assert ray.get(manager.versions.remote()) == [str(version + 1)] * 2
        finally:
            versions.close()
            ray.get(manager.shutdown.remote(), timeout=60)


class _Sightings:
    """Polls the router's list. ``all[url]``: every distinct (version, state) the url was listed in,
    in order; ``first[url]``: the first of them in a state the router routes to. Only ``ready``
    workers are routed to (``LeastOutstandingPolicy``); ``add_worker`` registers a URL as
    ``starting`` (no version yet: never probed) and probes it before it answers, so a poll may
    catch that instant: it is a sighting, not a routable one."""

    def __init__(self, router: RouterClient):
        self.first: dict[str, tuple] = {}
        self.all: dict[str, list[tuple]] = {}
        self._stop = threading.Event()
        self._router = router
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            try:
                workers = self._router.list_workers()
            except Exception:
                continue
            for worker in workers:
                sighting = (worker["weight_version"], worker["state"])
                seen = self.all.setdefault(worker["url"], [])
                if sighting not in seen:
                    seen.append(sighting)
                if worker["state"] == "ready":
                    self.first.setdefault(worker["url"], sighting)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
