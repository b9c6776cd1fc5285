"""The trainer restart on real Ray (issue 30, item 3): a job's two-rank trainer group, publishing
into a real version store and saving every two steps, loses rank 1 (``ray.kill``) at step 3.
``TrainerRestarts`` replaces the group, restores the step-2 save, republishes it as a full anchor
numbered after the store's newest version, rewinds the records and runs steps 2-4 again. With
``--max-trainer-restarts 0`` the same kill ends the loop with ``TrainerLost`` naming the rank.

The loop here is the test's own (train on fixed samples, publish, record, save): what is checked
is the restart machinery around it; the chaos run (``tests/e2e/test_chaos.py``) runs the real one."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch

from miles_disagg.samples import Sample
from miles_disagg.types import TrainerLost

pytestmark = pytest.mark.timeout(400)
NUM_STEPS = 5


def samples(n: int = 8) -> list[Sample]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 60, (3,), generator=generator).tolist()
        response = torch.randint(3, 60, (2 + i % 3,), generator=generator).tolist()
        out.append(Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-4.0] * len(response),
                          advantage=float(i % 2) - 0.5, loss_mask=[1] * len(response)))
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory, tiny_qwen3_dir):
    """A started job with a trainer of two ranks and no engines (its own local Ray)."""
    from miles_disagg.config.loader import load_config
    from miles_disagg.loop.job import Job
    from miles_disagg.loop.preflight import prepare_run

    tmp = tmp_path_factory.mktemp("restart")
    saved = dict(os.environ)  # Job.start takes the run's keys into the environment: restored after
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["MILES_DISAGG_RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    config, _ = load_config(["--config", "configs/tiny_cpu.yaml", "--run-dir", str(tmp / "run"),
                             "--hf-checkpoint", str(tiny_qwen3_dir), "--actor-num-gpus-per-node", "2",
                             "--num-rollout", str(NUM_STEPS), "--rollout-batch-size", "1", "--n-samples-per-prompt", "8",
                             "--global-batch-size", "8", "--micro-batch-size", "4",
                             "--save", str(tmp / "saves"), "--save-interval", "2", "--max-trainer-restarts", "1"],
                            "train_async")
    prepare_run(config)
    started = Job.start(config, with_engines=False)
    try:
        yield started
    finally:
        started.stop()
        os.environ.clear()
        os.environ.update(saved)


def training_loop(kill_at_step: int, killed: list, seen: dict):
    """The loop ``TrainerRestarts`` runs: rank 1 is killed (once) as step ``kill_at_step`` starts;
    ``seen[step]``: rank 0's exported bytes when each step started."""
    import ray

    from miles_disagg.loop.resume import LoopState, maybe_save
    from miles_disagg.loop.updates import publish

    def loop(job, tracker, state, progress):
        version = state.version
        for step in range(state.step, NUM_STEPS):
            progress.step = step
            seen.setdefault(step, []).append(job.trainer.tensor_bytes())
            if step == kill_at_step and not killed:
                killed.append(step)
                ray.kill(job.trainer.ranks[1])
            job.trainer.train(samples())
            version, _ = publish(job, version)
            tracker.log(step, {"weights/version": version})
            maybe_save(job, LoopState(step + 1, version), last=step == NUM_STEPS - 1)

    return loop


def test_a_killed_rank_restarts_the_group_from_its_last_save(job) -> None:
    from miles_disagg.loop.records import open_tracker
    from miles_disagg.loop.resume import LoopState
    from miles_disagg.loop.trainer_restart import TrainerRestarts
    from miles_disagg.tracking import read_records
    from miles_disagg.weights.store import VersionStore

    run_dir = job.config.tracking.run_dir
    tracker = open_tracker(job.config, start_step=0)
    killed, seen = [], {}
    old_ranks = list(job.trainer.ranks)
    restarts = TrainerRestarts(job, tracker, resumed_from=None)
    restarts.run(training_loop(3, killed, seen), LoopState())
    tracker.close()

    assert killed == [3] and restarts.count == 1
    assert not set(job.trainer.ranks) & set(old_ranks)  # a new group
    lines = [json.loads(line) for line in open(f"{run_dir}/metrics.jsonl")]
    assert [r["step"] for r in lines] == list(range(NUM_STEPS))  # steps 2 and later once, from the restart
    # v1-v3 by the first group (save at step 2 holds v2); v4 = v2's state as a full anchor; then v5-v7
    assert [r["weights/version"] for r in lines] == [1, 2, 5, 6, 7]
    store = VersionStore(job.config.weights.update_weight_disk_dir)
    assert store.visible_versions() == [4, 5, 6, 7] and store.latest().version == 7  # older than the anchor: pruned
    assert store.read_index(4).delta_encoding == "full" and store.read_index(5).base_version == 4
    assert seen[2][1] == seen[2][0]  # the restored trainer holds exactly the saved policy
    [event] = read_records(f"{run_dir}/events.jsonl")
    assert event["event"] == "trainer_restart" and event["failed"].startswith("trainer rank 1 died")
    assert (event["failed_at_step"], event["resumed_from_step"], event["version"]) == (3, 2, 4)
    assert event["discarded_versions"] == [3, 3] and event["resumed_from"].endswith("iter_0000002")
    assert event["groups_dropped"] == 0 and event["restart_s"] > 0  # no rollout in this job


def test_without_restarts_a_killed_rank_ends_the_loop_with_one_error(job) -> None:
    from miles_disagg.loop.records import open_tracker
    from miles_disagg.loop.resume import LoopState
    from miles_disagg.loop.trainer_restart import TrainerRestarts

    tracker = open_tracker(job.config, start_step=None)
    restarts = TrainerRestarts(job, tracker, resumed_from=None, limit=0)
    latest = job.trainer.latest_published()["version"]
    with pytest.raises(TrainerLost) as raised:
        restarts.run(training_loop(NUM_STEPS - 1, [], {}), LoopState(step=NUM_STEPS - 1, version=latest))
    tracker.close()
    assert raised.value.rank == 1
    assert str(raised.value).startswith("trainer rank 1 died")
    assert "--max-trainer-restarts N restarts the trainer from its last save" in str(raised.value)
    assert restarts.count == 0


def test_the_kill_helper_finds_ranks_by_title_under_a_root_or_by_environment() -> None:
    """``tests/trainer_faults.py`` (used by the e2e run and the chaos test) on stand-in processes
    titled as Ray titles a trainer rank's worker."""
    import subprocess

    from trainer_faults import kill_trainer_rank, trainer_rank_pids

    marker = ("MILES_DISAGG_TEST_MARK", f"restart-{os.getpid()}")
    stand_in = subprocess.Popen(["bash", "-c", 'exec -a "ray::TrainerRank.train" sleep 120'],
                                env={**os.environ, marker[0]: marker[1]})
    other = subprocess.Popen(["bash", "-c", 'exec -a "ray::RolloutManager.take" sleep 120'])
    try:
        import time

        deadline = time.monotonic() + 30
        while stand_in.pid not in trainer_rank_pids(env=marker):
            assert time.monotonic() < deadline, "the stand-in never showed up"
            time.sleep(0.05)
        under_this_process = trainer_rank_pids(os.getpid())  # (with the module's job's own ranks)
        assert stand_in.pid in under_this_process and other.pid not in under_this_process
        assert trainer_rank_pids(env=marker) == [stand_in.pid]
        assert trainer_rank_pids(env=(marker[0], "another-cluster")) == []
        assert kill_trainer_rank(env=marker) == stand_in.pid
        assert stand_in.wait(timeout=30) == -9
        assert other.poll() is None  # not a trainer rank: left alone
    finally:
        for process in (stand_in, other):
            process.kill()
            process.wait()
