"""The engine set's one state owner (``fleet/slots.py``), and the router bookkeeping and node-loss
handling that change it, without Ray or engines: a fake router client records what it is told."""

from __future__ import annotations

import threading

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.fleet.replace import Replacements
from miles_disagg.fleet.routing import EngineRouting
from miles_disagg.fleet.slots import EngineSlots


CONFIG = EngineManagerConfig(cluster=ClusterConfig(actor_num_gpus_per_node=1), rollout=RolloutConfig(),
                             weights=WeightUpdateConfig(), model_path="/model", run_dir="/run")


class FakeRouterClient:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_worker(self, url: str) -> None:
        self.removed.append(url)


def three_engines() -> EngineSlots:
    slots = EngineSlots()
    assert slots.add("http://a:1", "/l/0", actor="actor-0", node="n0") == 0
    assert slots.add("http://b:1", "/l/1", actor="actor-1", node="n1") == 1
    assert slots.add("http://c:1", "/l/2") == 2  # attached
    return slots


def test_slots_hold_each_engines_address_directory_actor_and_node_by_index() -> None:
    slots = three_engines()
    assert (len(slots), list(slots.indices())) == (3, [0, 1, 2])
    assert slots.urls() == ["http://a:1", "http://b:1", "http://c:1"]
    assert slots.local_dirs() == ["/l/0", "/l/1", "/l/2"]
    assert [slots.is_managed(i) for i in slots.indices()] == [True, True, False] and slots.has_actors
    assert (slots.node(0), slots.node(2)) == ("n0", None)
    slots.urls().append("http://x:1")  # a copy: the set is unchanged
    assert len(slots) == 3
    slots.set_url(0, "http://a:2")
    slots.set_actor(1, None)
    slots.clear_actors()
    assert slots.url(0) == "http://a:2" and not any(slots.is_managed(i) for i in slots.indices())
    assert slots.has_actors  # the run was a managed one: its processes are checked through their actors


def test_an_attached_run_has_no_actors_until_a_managed_engine_joins() -> None:
    slots = EngineSlots()
    slots.add("http://a:1", "/l/0")
    assert not slots.has_actors
    slots.add("http://b:1", "/l/1", actor="joined")
    assert slots.has_actors and [slots.actor(i) for i in slots.indices()] == [None, "joined"]


def test_down_lost_removed_and_failed_checks() -> None:
    slots = three_engines()
    assert slots.mark_down(1) and not slots.mark_down(1)  # the second finder learns it is out already
    assert slots.down() == {1} and slots.serving() == 2
    slots.mark_lost(1)
    slots.mark_removed(2)
    assert slots.members() == [0, 1] and slots.is_lost(1) and slots.is_removed(2)
    assert [slots.count_health_check(0, ok) for ok in (False, False, True, False)] == [1, 2, 0, 1]
    slots.count_health_check(1, False)
    slots.replace(1, actor="actor-1b", url="http://d:1", node="n9", local_dir="/l/1b")
    assert not slots.is_lost(1) and slots.is_down(1)  # placed again: still out until restored
    assert (slots.url(1), slots.node(1), slots.local_dir(1), slots.actor(1)) == ("http://d:1", "n9", "/l/1b", "actor-1b")
    assert slots.count_health_check(1, False) == 1  # its count started again
    slots.mark_up(1)
    assert slots.down() == set()


def test_taking_an_engine_out_tells_the_router_once_and_records_it() -> None:
    slots = three_engines()
    routing = EngineRouting(CONFIG, slots, updater=None)
    routing.client = FakeRouterClient()
    routing.take_out(0)
    routing.take_out(0)  # the monitor and an update may both find it gone
    assert routing.client.removed == ["http://a:1"] and slots.down() == {0}
    assert [(e["engine"], e["event"], e["url"]) for e in slots.events] == [(0, "down", "http://a:1")]


class DeadNodes(Replacements):
    def __init__(self, *args, dead: set[str]) -> None:
        super().__init__(*args)
        self.dead = dead

    def _dead(self, nodes: set[str]) -> set[str]:
        return nodes & self.dead


def test_engines_on_a_node_ray_lists_as_gone_leave_the_router_once_and_are_recorded_lost() -> None:
    """Without a placement to place them on again (``placement=None``), nothing is started."""
    slots = three_engines()
    routing = EngineRouting(CONFIG, slots, updater=None)
    routing.client = FakeRouterClient()
    replacements = DeadNodes(CONFIG, None, slots, routing, threading.Event(), dead={"n1"})
    replacements.drop_lost_nodes()
    replacements.drop_lost_nodes()  # already lost: not again
    assert slots.is_lost(1) and slots.down() == {1} and routing.client.removed == ["http://b:1"]
    assert [(e["engine"], e["event"]) for e in slots.events] == [(1, "down"), (1, "node_lost")]
    assert slots.events[1]["why"] == "its node (id n1) left the Ray cluster" and not replacements.busy(1)

    replacements.engine_gone(0, "actor_lost", why="its actor is gone: died")  # its node lives: the actor's loss
    assert [e["event"] for e in slots.events if e["engine"] == 0] == ["down", "actor_lost"]


def test_an_engine_placed_again_is_recorded_and_placement_json_rewritten(tmp_path, monkeypatch) -> None:
    """Through the engine manager's wiring: ``Replacements._adopt`` (a lost engine's new actor, address
    and node) reaches ``Membership.engine_moved``; ``placement.json`` and ``membership.jsonl`` follow."""
    import dataclasses
    import json

    import miles_disagg.fleet.attach as attach
    from miles_disagg.fleet.manager import EngineManager

    manager = EngineManager(dataclasses.replace(CONFIG, run_dir=str(tmp_path)))
    manager.slots.add("http://a:1", "/l/0", actor="actor-0", node="n0")
    manager.slots.add("http://b:1", "/l/1", actor="actor-1", node="n1")
    manager.members.record_start()
    monkeypatch.setattr(attach, "engine_local_dir", lambda url, default: "/l/1-again")
    restored = []
    monkeypatch.setattr(manager.routing, "restore", restored.append)
    site = {"node_id": "n7", "node_ip": "10.0.0.7", "gpu_ids": ["3"]}
    manager.replacements._adopt(1, "actor-1b", "http://c:2", site)
    assert restored == [1] and manager.member_urls() == ["http://a:1", "http://c:2"]
    engines = json.loads((tmp_path / "placement.json").read_text())["engines"]
    assert [(e["address"], e["node_ip"], e["node_id"], e["gpu_ids"], e["local_checkpoint_dir"]) for e in engines] == [
        ("http://a:1", "a", None, [], "/l/0"), ("http://c:2", "10.0.0.7", "n7", ["3"], "/l/1-again")]
    lines = [json.loads(line) for line in (tmp_path / "membership.jsonl").read_text().splitlines()]
    assert [(r["action"], r["url"]) for r in lines] == [("start", "http://a:1"), ("start", "http://b:1"),
                                                        ("moved", "http://c:2")]
    assert lines[-1]["node"] == "10.0.0.7" and "placed again" in lines[-1]["why"]
    manager.monitor.on_moved(0, None)  # a restart by its actor (same bundle): the same wiring
    last = json.loads((tmp_path / "membership.jsonl").read_text().splitlines()[-1])
    assert (last["action"], last["engine"], last["why"]) == ("moved", 0, "restarted by its actor")


class ScriptedUpdater:
    """An updater whose first update fails as a killed engine's request does; later ones succeed."""

    def __init__(self, calls: list, urls: list[str]):
        self.calls, self.urls = calls, urls

    def update(self, version: int):
        from miles_disagg.engines.updater import UpdateFailed, UpdateReport

        self.calls.append(self.urls)
        if len(self.calls) == 1:
            raise UpdateFailed(f"prepare on {self.urls[-1]}: TransportFailed: Server disconnected")
        return UpdateReport(version, 0.1, 0.01, 0.2)

    def close(self) -> None:
        pass


def manager_with_two_engines(tmp_path, monkeypatch, answers_of_engine_1: list[bool]):
    """An engine manager (no Ray) whose engine 1's process is reported alive as ``answers_of_engine_1``
    says, one answer per question, the last one from then on; returns it and the updaters' engine lists."""
    import dataclasses

    from miles_disagg.fleet import manager as manager_module
    from miles_disagg.fleet.manager import EngineManager

    manager = EngineManager(dataclasses.replace(CONFIG, run_dir=str(tmp_path)))
    manager.slots.add("http://a:1", "/l/0", actor="actor-0", node="n0")
    manager.slots.add("http://b:1", "/l/1", actor="actor-1", node="n1")
    answers = list(answers_of_engine_1)
    monkeypatch.setattr(manager.monitor, "alive", lambda i: True if i == 0 else (answers.pop(0) if len(answers) > 1
                                                                                   else answers[0]))
    monkeypatch.setattr(manager.monitor.routing, "take_out", lambda i: None)
    calls: list = []
    monkeypatch.setattr(manager, "_updater", lambda indices: ScriptedUpdater(calls, [manager.slots.url(i) for i in indices]))
    monkeypatch.setattr(manager_module, "DEATH_GRACE_S", 1.0)
    return manager, calls


def test_an_engine_killed_mid_update_is_left_out_even_when_its_death_is_seen_a_moment_late(tmp_path, monkeypatch) -> None:
    """A SIGKILLed engine's request fails before its process is seen gone (sockets close before the
    process exits): the update waits for the death, then goes again without it (the chaos run met
    this as ``UpdateFailed`` ending the run)."""
    manager, calls = manager_with_two_engines(tmp_path, monkeypatch, [True, True, True, False])
    assert manager.update_weights(3)["perf/update_weights_prepare_time"] == 0.1
    assert calls == [["http://a:1", "http://b:1"], ["http://a:1"]] and manager.slots.version == 3


def test_an_update_a_live_engine_fails_still_fails(tmp_path, monkeypatch) -> None:
    import pytest

    from miles_disagg.engines.updater import UpdateFailed

    manager, calls = manager_with_two_engines(tmp_path, monkeypatch, [True])
    with pytest.raises(UpdateFailed, match="prepare on http://b:1"):
        manager.update_weights(3)
    assert len(calls) == 1 and manager.slots.version != 3
