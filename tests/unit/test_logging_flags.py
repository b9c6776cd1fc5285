"""miles' logging flags with miles' meaning, and the tracking backends they drive (tensorboard and wandb
are real here: the setup installs the tracking extra; wandb runs offline, without a network)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from miles_disagg.config import load_config
from miles_disagg.tracking import MetricsTracker, WandbOptions, pass_at_k, read_metrics, tensorboard_dir
from miles_disagg.types import ConfigError

LOGGING = ["--use-wandb", "--wandb-host", "https://wandb.example", "--wandb-mode", "offline", "--wandb-dir", "/tmp/w",
           "--wandb-run-id", "abc123", "--disable-wandb-random-suffix", "--use-tensorboard", "--tb-project-name",
           "/tmp/tb", "--tb-experiment-name", "exp", "--log-passrate", "--loss-type", "policy_loss"]


def test_miles_logging_flags_are_taken_with_their_values() -> None:
    config, _ = load_config(LOGGING, "train_async")
    t = config.tracking
    assert (t.wandb_host, t.wandb_mode, t.wandb_dir, t.wandb_run_id) == ("https://wandb.example", "offline", "/tmp/w",
                                                                           "abc123")
    assert t.disable_wandb_random_suffix and t.log_passrate and config.train.loss_type == "policy_loss"
    assert (t.tb_project_name, t.tb_experiment_name) == ("/tmp/tb", "exp")
    with pytest.raises(ConfigError, match="--wandb-mode: invalid choice"):
        load_config(["--wandb-mode", "sometimes"], "train_async")


def test_dump_details_dumps_each_steps_groups_unless_a_path_is_given(tmp_path: Path) -> None:
    config, _ = load_config(["--dump-details", str(tmp_path / "d")], "train_async")
    assert config.rollout.save_debug_rollout_data == str(tmp_path / "d" / "rollout_data" / "{rollout_id}.jsonl")
    given = str(tmp_path / "mine-{rollout_id}.jsonl")
    config, _ = load_config(["--dump-details", str(tmp_path / "d"), "--save-debug-rollout-data", given], "train_async")
    assert config.rollout.save_debug_rollout_data == given


def test_miles_loss_types_load_and_a_custom_loss_needs_its_function() -> None:
    assert load_config(["--loss-type", "sft_loss"], "train_async")[0].train.loss_type == "sft_loss"
    with pytest.raises(ConfigError, match="^--loss-type custom_loss needs --custom-loss-function-path"):
        load_config(["--loss-type", "custom_loss"], "train_async")


def test_disable_rollout_global_dataset_needs_a_rollout_function() -> None:
    with pytest.raises(ConfigError, match="--disable-rollout-global-dataset .* --rollout-function-path"):
        load_config(["--disable-rollout-global-dataset"], "train_async")
    config, _ = load_config(["--disable-rollout-global-dataset", "--rollout-function-path", "pkg.mod.fn"],
                            "train_async")
    assert config.rollout.disable_rollout_global_dataset


def test_offload_flags_are_what_colocate_does() -> None:
    colocated = ["--colocate", "--train-backend", "fsdp"]
    for flag in ("--offload", "--offload-train", "--offload-rollout"):
        load_config([*colocated, flag], "train")
        with pytest.raises(ConfigError) as info:
            load_config([flag], "train_async")
        assert str(info.value).startswith(f"{flag} is a miles flag that does not apply here: ")
        assert "add --colocate" in str(info.value)
    with pytest.raises(ConfigError, match="--no-offload-train is a miles flag .* always offloads both sides"):
        load_config([*colocated, "--no-offload-train"], "train")


def test_tensorboard_dir_has_miles_meaning(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    run = tmp_path / "runs" / "r7"
    assert tensorboard_dir(run, None, None) == run / "tensorboard"
    assert tensorboard_dir(run, str(tmp_path / "tb"), None) == tmp_path / "tb" / "r7"
    assert tensorboard_dir(run, str(tmp_path / "tb"), "exp") == tmp_path / "tb" / "exp"
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env"))
    assert tensorboard_dir(run, None, "exp") == tmp_path / "env" / "exp"


def test_tensorboard_writes_event_files_where_asked(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tracking extra is not installed")
    target = tmp_path / "tb" / "exp"
    with MetricsTracker(tmp_path / "run", use_tensorboard=True, tensorboard_dir=target) as tracker:
        tracker.log(0, {"rollout/raw_reward": 0.5})
        tracker.log_stream("train_steps", 0, {"train/loss": 1.0})
    assert list(target.glob("events.out.tfevents.*"))


def test_wandb_offline_logs_without_a_network(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb", reason="the tracking extra is not installed")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    options = WandbOptions(project="p", group="g", mode="offline", random_suffix=False)
    with MetricsTracker(tmp_path / "run", use_wandb=True, wandb_options=options, run_config={"lr": 1e-3}) as tracker:
        tracker.log(0, {"rollout/raw_reward": 0.5})
        tracker.log(1, {"rollout/raw_reward": 0.6})
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
    assert [r["rollout/raw_reward"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0.5, 0.6]


def test_wandb_run_name_suffix() -> None:
    run = Path("/runs/r9")
    assert WandbOptions(group="g").run_name(run, "abc123") == "g_abc123"
    assert WandbOptions(group="g", random_suffix=False).run_name(run, "abc123") == "g"
    assert WandbOptions().run_name(run, "x") == "r9_x"


@pytest.mark.parametrize("module, flag", [("wandb", "--use-wandb"), ("torch.utils.tensorboard", "--use-tensorboard")])
def test_a_backend_asked_for_but_missing_is_a_config_error(tmp_path: Path, monkeypatch, module: str, flag: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=f"{flag}: .* is not installed"):
        MetricsTracker(tmp_path, **{flag.removeprefix("--").replace("-", "_"): True})


def test_pass_at_k_is_miles_unbiased_estimate() -> None:
    metrics = pass_at_k([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    assert set(metrics) == {"rollout/pass@1", "rollout/pass@2", "rollout/pass@4"}
    assert metrics["rollout/pass@1"] == pytest.approx((0.25 + 0.5 + 0) / 3)
    assert metrics["rollout/pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert metrics["rollout/pass@4"] == pytest.approx((1 + 1 + 0) / 3)
    assert pass_at_k([[0.5, 0.99]]) == {"rollout/pass@1": 0.0, "rollout/pass@2": 0.0}  # only a reward of 1 passes
    assert pass_at_k([]) == {}


def test_logging_flags_reach_print_config(tmp_path: Path) -> None:
    config, _ = load_config([*LOGGING, "--wandb-key", "s3cret"], "train_async")
    from miles_disagg.config.loader import config_to_dict

    shown = json.dumps(config_to_dict(config))
    assert "s3cret" not in shown and '"wandb_host": "https://wandb.example"' in shown


def test_the_runs_tracker_takes_the_flags(tmp_path: Path, monkeypatch) -> None:
    """``open_tracker`` (what train.py / train_async.py open): tensorboard under --tb-project-name /
    --tb-experiment-name, wandb offline under --wandb-dir."""
    pytest.importorskip("wandb", reason="the tracking extra is not installed")
    pytest.importorskip("tensorboard", reason="the tracking extra is not installed")
    from miles_disagg.loop.records import open_tracker

    for name in ("WANDB_API_KEY", "WANDB_MODE", "TENSORBOARD_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    config, _ = load_config(["--run-dir", str(tmp_path / "run"), "--use-tensorboard", "--tb-project-name",
                             str(tmp_path / "tb"), "--tb-experiment-name", "exp", "--use-wandb", "--wandb-mode",
                             "offline", "--wandb-dir", str(tmp_path / "wb"), "--wandb-project", "p",
                             "--disable-wandb-random-suffix", "--wandb-group", "g"], "train_async")
    with open_tracker(config, start_step=0) as tracker:
        tracker.log(0, {"rollout/raw_reward": 0.25})
    assert list((tmp_path / "tb" / "exp").glob("events.out.tfevents.*"))
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1


def test_without_a_global_dataset_get_samples_is_refused_naming_the_flag() -> None:
    import pickle

    from miles_disagg.rollout.hook_args import PromptSamples
    from miles_disagg.rollout.manager import _no_global_dataset

    source = PromptSamples(_no_global_dataset, lambda prompt, n: [prompt] * n, 2)
    with pytest.raises(ConfigError) as info:
        source.get_samples(4)
    assert info.value.flags == ("--disable-rollout-global-dataset",) and "get_samples(4)" in str(info.value)
    again = pickle.loads(pickle.dumps(info.value))  # it crosses the rollout manager's Ray boundary
    assert str(again) == str(info.value) and again.flags == info.value.flags
