"""A lost rollout node costs capacity, not the run (issue 30 item 2), without Ray: the capacity
policy and its watch (``--min-rollout-engines``), the node watch that tolerates rollout-only
nodes and hands trainer nodes to the trainer path's seam, the flags' checks, and the summary
line of what the engines lost and got back."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from miles_disagg.launcher import main
from miles_disagg.fleet.capacity import CapacityPolicy
from miles_disagg.loop.capacity import CapacityWatch
from miles_disagg.loop.cluster import NodeWatch, write_engine_events
from miles_disagg.loop.report import write_report
from miles_disagg.types import NodeLost, RolloutCapacityLost


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_policy_ends_the_run_only_after_too_few_engines_for_longer_than_the_timeout() -> None:
    clock = Clock()
    policy = CapacityPolicy(min_engines=2, timeout_s=30, clock=clock)
    policy.observe(3, 3)
    assert policy.verdict() is None
    policy.observe(1, 3)  # a node went
    clock.now += 30
    assert policy.verdict() is None  # not longer than the timeout yet
    policy.observe(2, 3)  # one came back: the clock starts again next time
    clock.now += 100
    assert policy.verdict() is None and policy.below_for() == 0
    policy.observe(1, 3)
    clock.now += 30.5
    assert policy.verdict("engine 2: its node left") == (
        "only 1 of 3 rollout engine(s) served for 30s, fewer than --min-rollout-engines 2 for longer than "
        "--min-rollout-engines-timeout 30s; engine 2: its node left")
    assert policy.state() == {"live": 1, "total": 3, "min_engines": 2, "below_for_s": 30.5}


def test_the_capacity_watch_raises_the_managers_line_and_keeps_raising_it() -> None:
    clock, answers = Clock(), []
    watch = CapacityWatch(lambda: answers.pop(0), interval_s=2, clock=clock)
    answers.append({"verdict": None})
    watch()
    watch()  # within the interval: not asked again (answers is empty)
    clock.now += 2
    answers.append({"verdict": "only 0 of 2 rollout engine(s) served ..."})
    with pytest.raises(RolloutCapacityLost, match=r"^only 0 of 2 rollout engine\(s\) served \.\.\.$") as lost:
        watch()
    with pytest.raises(RolloutCapacityLost):
        watch()  # stays lost without asking
    assert isinstance(pickle.loads(pickle.dumps(lost.value)), RolloutCapacityLost)


def test_the_capacity_watch_ignores_a_manager_that_does_not_answer() -> None:
    def busy() -> dict:
        raise TimeoutError("busy")

    CapacityWatch(busy, interval_s=0)()


WORK = {"t" * 56: {"node_ip": "10.0.0.1", "work": ["trainer rank 0"]},
        "r" * 56: {"node_ip": "10.0.0.2", "work": ["engine 0"]},
        "s" * 56: {"node_ip": "10.0.0.3", "work": ["engine 1"]}}


def test_a_rollout_node_lost_costs_capacity_when_engines_are_placed_again(capsys) -> None:
    alive = set(WORK)
    watch = NodeWatch(WORK, alive_nodes=lambda: set(alive), interval_s=0, engines_replaced=True)
    alive.discard("r" * 56)
    watch()
    watch()
    assert watch.handled == ["r" * 56]
    err = capsys.readouterr().err
    assert err.count("node 10.0.0.2 (id " + "r" * 56 + ") left the Ray cluster; engine 0 ran there: out of the "
                     "router now, placed again when the cluster offers their resources") == 1
    alive.discard("t" * 56)
    with pytest.raises(NodeLost, match=r"node 10\.0\.0\.1 .* trainer rank 0 ran there, so the run cannot go on"):
        watch()


def test_without_replacement_a_rollout_node_lost_still_ends_the_run() -> None:
    watch = NodeWatch(WORK, alive_nodes=lambda: set(WORK) - {"s" * 56}, interval_s=0)
    with pytest.raises(NodeLost, match="engine 1 ran there, so the run cannot go on"):
        watch()


def test_a_trainer_node_lost_goes_to_the_trainer_paths_handler_when_given() -> None:
    taken: list[NodeLost] = []
    watch = NodeWatch(WORK, alive_nodes=lambda: set(WORK) - {"t" * 56}, interval_s=0, engines_replaced=True,
                      on_trainer_node_lost=taken.append)
    watch()
    watch()
    assert [t.node_id for t in taken] == ["t" * 56]

    def cannot(lost: NodeLost) -> None:
        raise NodeLost(f"{lost}; --max-trainer-restarts reached")

    refusing = NodeWatch(WORK, alive_nodes=lambda: set(WORK) - {"t" * 56}, interval_s=0, on_trainer_node_lost=cannot)
    with pytest.raises(NodeLost, match="--max-trainer-restarts reached$"):
        refusing()


@pytest.mark.parametrize("argv, message", [
    (["--rollout-num-gpus", "2", "--min-rollout-engines", "3"],
     "--min-rollout-engines 3 is more than the 2 engine(s) this run has "
     "(--rollout-num-gpus / --rollout-num-gpus-per-engine)"),
    (["--min-rollout-engines", "0"], "--min-rollout-engines must be >= 1"),
    (["--min-rollout-engines-timeout", "-1"], "--min-rollout-engines-timeout must be >= 0"),
])
def test_bad_min_engines_flags_exit_2_naming_the_flag(argv, message, tmp_path: Path, capsys) -> None:
    code = main("train_async", ["--num-rollout", "1", "--rollout-batch-size", "1", "--actor-num-gpus-per-node", "1",
                                "--run-dir", str(tmp_path / "run"), *argv])
    assert code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_summary_says_what_the_engines_lost_and_got_back(tmp_path: Path, capsys) -> None:
    events = [{"engine": 0, "event": "down", "url": "http://a:1"},
              {"engine": 0, "event": "restored", "url": "http://a:2", "version": 2},
              {"engine": 1, "event": "node_lost", "url": "http://b:1", "node_id": "n" * 56, "why": "its node left"},
              {"engine": 1, "event": "down", "url": "http://b:1"},
              {"engine": 1, "event": "replaced", "url": "http://c:1", "node_id": "m" * 56},
              {"engine": 1, "event": "restored", "url": "http://c:1", "version": 4},
              {"event": "router_restarted", "why": "its process exited (code -9)", "url": "http://r:1", "workers": []}]
    write_engine_events(tmp_path, events)
    assert json.loads((tmp_path / "engine_events.json").read_text()) == events
    summary = write_report(tmp_path)
    assert summary["engine_faults"] == {"nodes_lost": ["n" * 56], "engines_lost_with_node": [1],
                                        "engines_lost_with_actor": [], "went_down": 2, "replaced": 1, "restored": 2,
                                        "failed_recoveries": 0, "not_restarted": [], "router_restarts": 1}
    assert json.loads((tmp_path / "summary.json").read_text())["engine_faults"] == summary["engine_faults"]
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "engines: 1 node(s) lost (engines [1]), 2 engine outage(s); 1 placed again, 2 caught up and routed again; "
        "router restarted 1 time(s)")


def test_the_verdict_names_why_each_engine_still_out_left() -> None:
    clock = Clock()
    policy = CapacityPolicy(min_engines=1, timeout_s=5, clock=clock)
    policy.observe(0, 3)
    clock.now += 6
    events = [{"engine": 0, "event": "node_lost", "why": "its node (id n1) left the Ray cluster"},
              {"engine": 2, "event": "actor_lost", "why": "its actor is gone: died"}]
    report = policy.report(events, down={0, 1})  # engine 2 was placed again and serves
    assert report["verdict"].endswith("; engine 0: its node (id n1) left the Ray cluster; engine 1: down (its process "
                                      "exited or it failed its health checks)")
    assert (report["live"], report["total"]) == (0, 3)
