"""The router's view of workers that keep several LoRA adapter versions resident: the older ones an engine
lists (``resident_weight_versions``) take exact-version requests, sent with that version's ``lora_path``;
``min_version`` is judged against the newest alone; a multi-process router's followers see the same set;
the engine's ``--lora-resident-versions`` is bounded by its adapter slots."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from miles_disagg.router.peers import FollowerPeers, LeaderPeers
from miles_disagg.router.policy import (LeastOutstandingPolicy, pinned_body, pinned_path, ready_versions,
                                        version_served, worker_satisfies)
from miles_disagg.router.registry import MAX_OLDER_VERSIONS, WorkerRegistry, parse_older_versions
from miles_disagg.router.shared_table import SharedTable, SlotRecord
from miles_disagg.types import VersionConstraint, VersionNotReady

EXACT = lambda n: VersionConstraint(exact_version=n)  # noqa: E731


def lora_worker(registry: WorkerRegistry, url: str, newest: int, older: dict[int, str]):
    worker = registry.add(url)
    registry.record_probe_ok(worker, newest, registry.ticket(worker), older)
    return worker


def test_exact_requests_reach_a_worker_holding_the_version_among_its_older_ones() -> None:
    registry = WorkerRegistry()
    plain = lora_worker(registry, "http://plain:1", 2, {})
    sets = lora_worker(registry, "http://sets:1", 3, {1: "v1", 2: "v2"})
    policy = LeastOutstandingPolicy()
    assert policy.choose_in(registry, EXACT(1)) is sets  # only it holds 1
    assert {policy.choose_in(registry, EXACT(2)) for _ in range(4)} == {plain, sets}  # newest of one, older of the other
    assert policy.choose_in(registry, EXACT(3)) is sets
    with pytest.raises(VersionNotReady) as refused:
        policy.choose_in(registry, EXACT(0))
    assert refused.value.available == [1, 2, 3] == ready_versions(registry.workers())
    # min_version against the newest alone: an older resident version never serves it
    assert policy.choose_in(registry, VersionConstraint(min_version=3)) is sets
    assert not worker_satisfies(plain, VersionConstraint(min_version=3))
    assert worker_satisfies(sets, VersionConstraint(exact_version=1, run_id=None))
    assert not worker_satisfies(sets, VersionConstraint(exact_version=1, run_id="other-run"))


def test_the_request_is_sent_with_the_lora_path_of_the_version_it_is_pinned_to() -> None:
    registry = WorkerRegistry()
    sets = lora_worker(registry, "http://sets:1", 3, {1: "v1", 2: "v2"})
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    assert pinned_body(body, sets, EXACT(1)) == {**body, "lora_path": "v1"}
    assert pinned_body(body, sets, EXACT(3)) is None  # the newest: served to a request naming no adapter
    assert pinned_body(body, sets, VersionConstraint()) is None
    assert pinned_body({**body, "lora_path": "mine"}, sets, EXACT(1)) is None  # the client's own choice stands
    assert (pinned_path(sets, EXACT(2)), version_served(sets, EXACT(2)), version_served(sets, EXACT(3))) == ("v2", 2, 3)
    assert "lora_path" not in body  # never changed in place


def test_probes_set_the_older_versions_and_answers_of_them_do_not_move_the_version() -> None:
    registry = WorkerRegistry()
    worker = lora_worker(registry, "http://sets:1", 2, {1: "v1"})
    registry.observe_version(worker, 1)  # a request that ran on v1 reports 1
    assert (worker.weight_version, worker.probe_due) == (2, False)
    registry.observe_version(worker, 3)  # activated meanwhile: forward at once, older versions until the next probe
    assert (worker.weight_version, dict(worker.older_versions)) == (3, {1: "v1"})
    registry.record_probe_ok(worker, 3, registry.ticket(worker), {2: "v2"})  # v1 evicted
    assert dict(worker.older_versions) == {2: "v2"} and worker.to_json()["older_versions"] == {"2": "v2"}
    assert LeastOutstandingPolicy().choose(registry.workers(), EXACT(2)) is worker
    with pytest.raises(VersionNotReady):
        LeastOutstandingPolicy().choose(registry.workers(), EXACT(1))


def test_a_malformed_resident_list_is_refused_naming_it() -> None:
    assert parse_older_versions(None, 4) == {}
    assert parse_older_versions({"2": "v2", "3": "v3", "4": "v4"}, 4) == {2: "v2", 3: "v3"}
    for listed, newest, fragment in (
        (["v1"], 4, "object"),
        ({"x": "v1"}, 4, "not a version"),
        ({"1": ""}, 4, "not a version"),
        ({"1": 5}, 4, "not a version"),
        ({"5": "v5"}, 4, "newer than weight_version 4"),
        ({"1": "v1"}, None, "newer than weight_version None"),
        ({str(v): "v" for v in range(MAX_OLDER_VERSIONS + 2)}, MAX_OLDER_VERSIONS + 2, "at most"),
        ({str(v): "p" * 200 for v in range(4)}, 4, "bytes"),
    ):
        with pytest.raises(ValueError, match=fragment):
            parse_older_versions(listed, newest)


def test_a_followers_view_holds_the_same_older_versions(tmp_path: Path) -> None:
    table = SharedTable.create(tmp_path / "table", 2)
    leader = LeaderPeers(WorkerRegistry(), table)
    hints: list[dict] = []
    follower = FollowerPeers(WorkerRegistry(), SharedTable.attach(tmp_path / "table"), 1, hint=hints.append)
    table.set_proc(1, 0, 4242.0)
    lora_worker(leader.registry, "http://sets:1", 3, {1: "v1", 2: "v2"})
    follower.sync()
    mine = follower.registry.get("http://sets:1")
    assert dict(mine.older_versions) == {1: "v1", 2: "v2"}
    assert LeastOutstandingPolicy().choose_in(follower.registry, EXACT(1)) is mine
    follower.observe_version(mine, 1)  # an answer on v1 is no news for the leader
    assert hints == []
    record = SlotRecord(5, True, "http://x:1", "ready", True, False, 3, None, 0, ((1, "v1"), (2, "v2")))
    table.write(record)
    reader = SharedTable.attach(tmp_path / "table")
    assert reader.changes_since(table.seq - 1)[1] == [record]
    reader.close()
    table.close()


def test_the_engines_resident_versions_flag_is_bounded_by_its_adapter_slots(tmp_path: Path) -> None:
    from miles_disagg.engines.builtin.config import EngineConfig

    lora = {"model_path": tmp_path, "enable_lora": True, "lora_base_dir": tmp_path}
    assert EngineConfig(**lora).lora_resident_versions == 2
    EngineConfig(**lora, lora_resident_versions=4, max_loaded_loras=6)
    for bad in ({"lora_resident_versions": 0}, {"lora_resident_versions": 3}):
        with pytest.raises(ValueError, match="--lora-resident-versions"):
            EngineConfig(**lora, **bad)


class _Answer:
    def __init__(self, body: dict):
        self.status_code, self.headers, self._body = 200, {}, body
        self.text = json.dumps(body)

    def json(self) -> dict:
        return self._body


class _Engine:
    """What a probe reads of an engine: ``/health`` and ``/model_info`` (``info``)."""

    def __init__(self, info: dict):
        self.info = info

    async def get(self, url: str, path: str, headers=None) -> _Answer:
        return _Answer(self.info if path == "/model_info" else {})


def test_a_probe_reads_the_set_and_a_malformed_one_takes_the_worker_out_naming_it() -> None:
    from miles_disagg.router.health import HealthChecker

    registry = WorkerRegistry()
    worker = registry.add("http://sets:1")
    engine = _Engine({"weight_version": "3", "resident_weight_versions": {"2": "v2", "3": "v3"}})
    checker = HealthChecker(registry, client=engine, interval_s=1.0)
    asyncio.run(checker.check(worker))
    assert (worker.state.value, worker.weight_version, dict(worker.older_versions)) == ("ready", 3, {2: "v2"})
    engine.info = {"weight_version": "3", "resident_weight_versions": {"4": "v4"}}
    asyncio.run(checker.check(worker))
    assert worker.state.value == "unhealthy" and "resident_weight_versions lists 4" in worker.last_error
    engine.info = {"weight_version": "4"}  # an engine of one version: no older ones
    asyncio.run(checker.check(worker))
    assert (worker.state.value, worker.weight_version, dict(worker.older_versions)) == ("ready", 4, {})
