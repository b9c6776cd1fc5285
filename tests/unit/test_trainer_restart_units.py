"""The pieces of ``--max-trainer-restarts`` (issue 30, item 3) that need no Ray: the flag's checks,
what counts as a trainer failure, the buffer's discarded versions, the tracker's rewind, the
summary's restart lines and the launcher's one line when restarts are off or used up."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_disagg.config import load_config
from miles_disagg.loop.resume import LoopState
from miles_disagg.loop.trainer_restart import TrainerRestarts, trainer_failure
from miles_disagg.rollout.buffer import GroupBuffer
from miles_disagg.tracking import MetricsTracker, read_records
from miles_disagg.samples import Group, Sample
from miles_disagg.types import ConfigError, NodeLost, TrainerLost

DD = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/shared/updates",
      "--update-weight-local-checkpoint-dir", "/local/ckpt"]


@pytest.mark.parametrize("extra, named, fragment", [
    (["--max-trainer-restarts", "-1"], ("--max-trainer-restarts",), "must be >= 0"),
    (["--max-trainer-restarts", "2"], ("--max-trainer-restarts", "--save"), "needs --save DIR"),
    (["--max-trainer-restarts", "1", "--save", "/s", "--update-weight-transfer-mode", "broadcast"],
     ("--max-trainer-restarts", "--update-weight-transfer-mode"), "needs --update-weight-transfer-mode disk-delta"),
])
def test_the_flag_is_checked_naming_the_flags(tmp_path: Path, extra, named, fragment) -> None:
    with pytest.raises(ConfigError, match=fragment) as info:
        load_config(DD + ["--hf-checkpoint", str(tmp_path)] + extra, "train_async")
    assert set(named) <= set(info.value.flags)


def test_the_flag_defaults_to_no_restart_and_takes_a_count(tmp_path: Path) -> None:
    config, _ = load_config(DD + ["--hf-checkpoint", str(tmp_path)], "train_async")
    assert config.train.max_trainer_restarts == 0
    config, _ = load_config(DD + ["--hf-checkpoint", str(tmp_path), "--save", "/s", "--max-trainer-restarts", "3"],
                            "train_async")
    assert config.train.max_trainer_restarts == 3


def fake_job(limit: int = 1, trainer_nodes=("node-t",)):
    config = SimpleNamespace(train=SimpleNamespace(max_trainer_restarts=limit, save=None))
    return SimpleNamespace(config=config, trainer=SimpleNamespace(node_ids=list(trainer_nodes)), node_watch=None)


def test_trainer_failures_are_a_lost_rank_or_a_lost_trainer_node() -> None:
    job = fake_job()
    assert trainer_failure(TrainerLost("trainer rank 1 died", rank=1), job) == "trainer rank 1 died"
    assert trainer_failure(NodeLost("node t left", node_id="node-t"), job) == "node t left"
    assert trainer_failure(NodeLost("node r left", node_id="node-r"), job) is None  # a rollout node
    assert trainer_failure(RuntimeError("loss is nan"), job) is None


def failing_loop(error: Exception):
    def loop(job, tracker, state, progress):
        progress.step = 3
        raise error
    return loop


def test_with_restarts_off_a_lost_rank_ends_the_run_saying_how_to_restart() -> None:
    with pytest.raises(TrainerLost, match=r"^trainer rank 1 died \(--max-trainer-restarts N restarts") as raised:
        TrainerRestarts(fake_job(limit=0), None, None).run(failing_loop(TrainerLost("trainer rank 1 died", rank=1)),
                                                           LoopState())
    assert raised.value.rank == 1


def test_other_errors_are_not_restarted() -> None:
    error = RuntimeError("loss is nan")
    with pytest.raises(RuntimeError) as raised:
        TrainerRestarts(fake_job(limit=5), None, None).run(failing_loop(error), LoopState())
    assert raised.value is error


def test_used_up_restarts_end_the_run_with_the_count(monkeypatch) -> None:
    restarts = TrainerRestarts(fake_job(limit=2), None, None)
    calls = []
    monkeypatch.setattr(restarts, "_restart", lambda what, progress, lost_node: calls.append(what) or LoopState())
    with pytest.raises(TrainerLost, match=r"restarted 2 time\(s\) already: --max-trainer-restarts 2"):
        restarts.run(failing_loop(TrainerLost("trainer rank 0 died", rank=0)), LoopState())
    assert calls == ["trainer rank 0 died"] * 2


def group(index: int, *calls: tuple[int, int]) -> Group:
    samples = [Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-0.1], weight_version_start=start,
                      weight_version_end=end) for start, end in calls]
    return Group(prompt_index=index, samples=samples)


def test_groups_of_discarded_versions_leave_the_buffer_and_are_refused_on_arrival() -> None:
    dropped = []
    buffer = GroupBuffer(None, on_dropped=dropped.append)  # unbounded staleness: only the discard drops
    buffer.put(group(0, (2, 2)))
    buffer.put(group(1, (3, 3)))
    buffer.put(group(2, (2, 4)))  # a call that ran into v4
    assert buffer.discard_versions(3, 4) == 2
    buffer.put(group(3, (4, 4)))  # still in flight at the restart: dropped on arrival
    buffer.put(group(4, (5, 5)))
    result = buffer.take(2, 5, timeout=1)
    assert [g.prompt_index for g in result.groups] == [0, 4]
    assert result.num_dropped == 3 and dropped == [2, 1]


def test_discarded_versions_must_be_a_range() -> None:
    from miles_disagg.types import InvalidInput

    with pytest.raises(InvalidInput, match="0 <= first <= last"):
        GroupBuffer(2).discard_versions(4, 3)


def test_the_tracker_rewinds_to_a_step_and_appends_after(tmp_path: Path) -> None:
    tracker = MetricsTracker(tmp_path)
    for step in range(4):
        tracker.log(step, {"x": step})
        tracker.log_stream("train_steps", step, {"rollout_step": step})
        tracker.log_stream("events", step, {"event": "e"})
    tracker.rewind(2)
    tracker.log(2, {"x": 20})
    tracker.log_stream("train_steps", 2, {"rollout_step": 2})
    tracker.close()
    assert [(r["step"], r["x"]) for r in read_records(tmp_path / "metrics.jsonl")] == [(0, 0), (1, 1), (2, 20)]
    assert [r["rollout_step"] for r in read_records(tmp_path / "train_steps.jsonl")] == [0, 1, 2]
    assert len(read_records(tmp_path / "events.jsonl")) == 4  # history is never rewound


def test_the_summary_lists_each_restart(tmp_path: Path, capsys) -> None:
    from miles_disagg.loop.report import write_report

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/raw_reward": 0.1}) + "\n"
                                                    for s in range(3)))
    event = {"step": 2, "event": "trainer_restart", "failed": "trainer rank 1 died", "failed_at_step": 3,
             "restart": 1, "max_restarts": 2, "resumed_from_step": 2, "resumed_from": "/s/iter_0000002", "version": 5,
             "discarded_versions": [4, 4]}
    (tmp_path / "events.jsonl").write_text(json.dumps(event) + "\n")
    summary = write_report(tmp_path)
    assert summary["trainer_restarts"][0]["failed"] == "trainer rank 1 died"
    assert json.loads((tmp_path / "summary.json").read_text())["trainer_restarts"][0]["version"] == 5
    assert ("trainer restart 1 of 2 at step 3: trainer rank 1 died; resumed from step 2 at v5"
            in capsys.readouterr().err)


def test_the_launcher_ends_a_lost_trainer_with_one_line_and_exit_1(tmp_path: Path, monkeypatch, capsys) -> None:
    from miles_disagg import launcher

    def run_training(config, entry):
        raise TrainerLost("trainer rank 0 died: ActorDiedError (--max-trainer-restarts N restarts the trainer "
                          "from its last save)", rank=0)

    monkeypatch.setattr(launcher, "check_runnable", lambda config: None)
    monkeypatch.setattr(launcher, "run_training", run_training)
    code = launcher.main("train_async", DD + ["--hf-checkpoint", str(tmp_path), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert err[0].startswith("train_async.py: failed: TrainerLost: trainer rank 0 died")


def test_a_lost_trainer_node_is_restarted_and_no_longer_watched(monkeypatch) -> None:
    from miles_disagg.loop import trainer_restart
    from miles_disagg.loop.cluster import NodeWatch
    from miles_disagg.remote import add_watch, remove_watch, run_watches

    nodes = {"node-t": {"node_ip": "10.0.0.1", "work": ["trainer rank 0"]},
             "node-r": {"node_ip": "10.0.0.2", "work": ["engine 0"]}}
    job = fake_job(limit=1)
    job.node_watch = NodeWatch(nodes, alive_nodes=lambda: {"node-r"}, interval_s=0)
    add_watch(job.node_watch)
    try:
        with pytest.raises(NodeLost) as lost:
            run_watches()
        restarts = TrainerRestarts(job, None, None)
        seen = []

        def restart(what, progress, lost_node):
            seen.append(lost_node)
            trainer_restart._stop_watching(job, lost_node)
            return LoopState()

        monkeypatch.setattr(restarts, "_restart", restart)
        assert restarts._recover(lost.value, trainer_restart.LoopProgress()) == LoopState()
        assert seen == ["node-t"] and set(job.node_watch.nodes) == {"node-r"}
        run_watches()  # the lost trainer node no longer ends every wait
    finally:
        remove_watch(job.node_watch)


def test_unwatching_a_trainer_node_keeps_the_rollout_nodes_the_run_went_on_without() -> None:
    """A rollout node lost earlier (its engines placed again) must not end the run once the trainer
    restarts: the watch keeps what it knew (the chaos run: node lost, then a trainer rank killed)."""
    from miles_disagg.loop import trainer_restart
    from miles_disagg.loop.cluster import NodeWatch

    nodes = {"node-t": {"node_ip": "10.0.0.1", "work": ["trainer rank 0"]},
             "node-r": {"node_ip": "10.0.0.2", "work": ["engine 0"]}}
    job = fake_job(limit=1)
    job.node_watch = NodeWatch(nodes, alive_nodes=lambda: {"node-t"}, interval_s=0, engines_replaced=True)
    job.node_watch()  # node-r lost: tolerated, its engines are placed again
    assert job.node_watch.handled == ["node-r"]
    trainer_restart._stop_watching(job, "node-t")
    assert set(job.node_watch.nodes) == {"node-r"} and job.node_watch.engines_replaced
    job.node_watch()  # still tolerated: not raised again as a lost node


def test_a_dead_rank_on_a_trainer_only_node_unwatches_that_node_only() -> None:
    from miles_disagg.loop.cluster import NodeWatch
    from miles_disagg.loop.trainer_restart import _node_to_unwatch

    job = fake_job()
    job.node_watch = NodeWatch({"node-t": {"node_ip": "10.0.0.1", "work": ["trainer rank 0", "trainer rank 1"]},
                            "node-x": {"node_ip": "10.0.0.2", "work": ["trainer rank 2", "engine 0"]}},
                           alive_nodes=lambda: {"node-t", "node-x"})
    assert _node_to_unwatch(TrainerLost("rank 1 died", rank=1, node_id="node-t"), job) == "node-t"
    assert _node_to_unwatch(TrainerLost("rank 2 died", rank=2, node_id="node-x"), job) is None  # engines there
    assert _node_to_unwatch(NodeLost("node x left", node_id="node-x"), job) == "node-x"
