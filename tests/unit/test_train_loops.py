"""The async loop's records, driven through the real ``train_async`` with fake trainer, rollout
and engines: each step's record is in metrics.jsonl as soon as the step is done (before the
activation of the version it published finishes), a run that dies keeps every completed
step, each optimizer step goes to ``train_steps.jsonl`` and each activation to ``updates.jsonl``."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from miles_disagg.config.components import RolloutConfig, RunConfig, TrainConfig, WeightUpdateConfig
from miles_disagg.loop.job import Job
from miles_disagg.loop.report import join_updates, summarize
from miles_disagg.loop.resume import LoopState
from miles_disagg.loop.train_loops import train_async
from miles_disagg.tracking import MetricsTracker, read_metrics
from miles_disagg.trainer.backend import TrainResult
from miles_disagg.samples import Group, RolloutBatch, Sample

STEPS = 4


class TrainerFailed(Exception):
    pass


class FakeTrainer:
    world_size = 1

    def __init__(self, fail_at: int | None = None):
        self.calls, self.fail_at, self.published = 0, fail_at, 0

    def train(self, samples):
        if self.calls == self.fail_at:
            raise TrainerFailed(f"trainer died at step {self.calls}")
        self.calls += 1
        return TrainResult(steps=[{"train/ppo_kl": 0.0, "train/pg_clipfrac": 0.0, "train/loss": 1.0},
                                  {"train/ppo_kl": 0.1, "train/pg_clipfrac": 0.2, "train/loss": 2.0}])

    def publish(self):
        self.published += 1
        version = self.published
        return SimpleNamespace(ref=SimpleNamespace(version=version),
                               metrics=lambda: {"weights/version": version, "perf/update_weights_wire_bytes": 1024})


class FakeRollout:
    def start(self):
        pass

    def take(self, num_groups, version):
        groups = [Group(i, [Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[-1.0], reward=r)
                            for r in (0.0, 1.0)]) for i in range(num_groups)]
        return RolloutBatch(groups, {"rollout/raw_reward": 0.5})

    def set_version(self, version):
        pass


class FakeEngines:
    """An activation's ``finish`` notes which step records were durable when the loop waited for it."""

    def __init__(self, metrics_path: Path):
        self.metrics_path = metrics_path
        self.seen_at_finish: dict[int, list[int]] = {}

    def refresh_engine_urls(self) -> bool:
        return False  # the same engines all run long

    def start_update(self, version):
        def finish():
            self.seen_at_finish[version] = [r["step"] for r in read_metrics(self.metrics_path)]
            return SimpleNamespace(metrics={"perf/update_weights_pause_time": 0.01 * version},
                                   engine_versions=[str(version)] * 2)

        return SimpleNamespace(finish=finish)


def run_loop(run_dir: Path, fail_at: int | None = None) -> FakeEngines:
    config = RunConfig(rollout=RolloutConfig(num_rollout=STEPS, rollout_batch_size=2),
                       weights=WeightUpdateConfig(update_weight_transfer_mode="disk-delta"), train=TrainConfig())
    engines = FakeEngines(run_dir / "metrics.jsonl")
    job = Job(config, trainer=FakeTrainer(fail_at), engines=engines, rollout=FakeRollout())
    with MetricsTracker(run_dir) as tracker:
        train_async(job, tracker, LoopState())
    return engines


def test_each_record_is_written_before_its_activation_is_waited_for(tmp_path: Path) -> None:
    engines = run_loop(tmp_path)
    # version v was published by step v - 1; when the loop waited for its activation, that
    # step's record (and every earlier one) was already on disk.
    assert engines.seen_at_finish == {v: list(range(v)) for v in range(1, STEPS + 1)}
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    assert [r["weights/version"] for r in records] == list(range(1, STEPS + 1))
    assert all("perf/update_weights_pause_time" not in r for r in records)  # it finished later
    updates = read_metrics(tmp_path / "updates.jsonl")
    assert [(u["step"], u["weights/version"]) for u in updates] == [(s, s + 1) for s in range(STEPS)]
    assert all(u["weights/engine_versions"] == [str(u["weights/version"])] * 2 for u in updates)
    joined = join_updates(records, updates)
    assert summarize(joined)["pause_time_max_s"] == pytest.approx(0.01 * STEPS)


def test_per_optimizer_step_stream_and_first_step_gates(tmp_path: Path) -> None:
    run_loop(tmp_path)
    steps = read_metrics(tmp_path / "train_steps.jsonl")
    assert [s["step"] for s in steps] == list(range(2 * STEPS))  # global optimizer step
    assert [(s["rollout_step"], s["step_in_rollout"]) for s in steps] == [(r, k) for r in range(STEPS) for k in (0, 1)]
    assert [s["train/ppo_kl"] for s in steps[:2]] == [0.0, 0.1]
    record = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert record["train/ppo_kl"] == pytest.approx(0.05)  # the rollout's mean over its steps
    assert record["train/ppo_kl_first_step"] == 0.0 and record["train/pg_clipfrac_first_step"] == 0.0


def test_a_run_that_dies_keeps_every_completed_step(tmp_path: Path) -> None:
    with pytest.raises(TrainerFailed):
        run_loop(tmp_path, fail_at=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1]  # step 1 is not lost
    assert [u["step"] for u in read_metrics(tmp_path / "updates.jsonl")] == [0]  # v2's activation never ended
    assert len(read_metrics(tmp_path / "train_steps.jsonl")) == 4


def test_log_passrate_adds_pass_at_k_to_each_step(tmp_path: Path) -> None:
    from miles_disagg.config.components import TrackingConfig

    config = RunConfig(rollout=RolloutConfig(num_rollout=2, rollout_batch_size=2),
                       weights=WeightUpdateConfig(update_weight_transfer_mode="disk-delta"), train=TrainConfig(),
                       tracking=TrackingConfig(log_passrate=True))
    job = Job(config, trainer=FakeTrainer(None), engines=FakeEngines(tmp_path / "metrics.jsonl"), rollout=FakeRollout())
    with MetricsTracker(tmp_path) as tracker:
        train_async(job, tracker, LoopState())
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["rollout/pass@1"], r["rollout/pass@2"]) for r in records] == [(0.5, 1.0), (0.5, 1.0)]
    run_loop(tmp_path / "off")
    assert all("rollout/pass@1" not in r for r in read_metrics(tmp_path / "off" / "metrics.jsonl"))
