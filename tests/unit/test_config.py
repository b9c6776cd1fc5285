"""Configuration: miles' flag names and defaults, YAML merge, validation rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_disagg.config import load_config, parse_host_port
from miles_disagg.types import ConfigError

DISK_DELTA = ["--update-weight-transfer-mode", "disk-delta", "--update-weight-disk-dir", "/shared/updates",
              "--update-weight-local-checkpoint-dir", "/local/ckpt"]


def disk_delta(base_dir: Path) -> list[str]:
    return DISK_DELTA + ["--hf-checkpoint", str(base_dir)]


def test_miles_defaults() -> None:
    config, print_only = load_config([], "train_async")
    assert not print_only
    assert config.cluster.actor_num_nodes == 1
    assert config.cluster.actor_num_gpus_per_node == 8
    assert config.cluster.rollout_num_gpus_per_engine == 1
    assert config.cluster.colocate is False
    assert config.weights.update_weight_transfer_mode == "broadcast"
    assert config.weights.update_weight_delta_encoding == "xor"
    assert config.weights.update_weight_delta_checksum == "xxh3-128"
    assert config.weights.update_weights_interval == 1
    assert config.rollout.pause_generation_mode == "retract"
    assert config.rollout.n_samples_per_prompt == 1
    assert config.rollout.max_weight_staleness is None


def test_flags_map_into_typed_sections(tmp_path: Path) -> None:
    config, _ = load_config(disk_delta(tmp_path) + [
        "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "8",
        "--rollout-num-gpus-per-engine", "2", "--update-weight-delta-encoding", "overwrite",
        "--update-weight-delta-checksum", "blake3", "--max-weight-staleness", "3",
        "--pause-generation-mode", "in_place", "--update-weights-interval", "2", "--num-rollout", "5",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "8", "--global-batch-size", "32",
        "--custom-update-weight-post-write-path", "pkg.hooks:after_write",
        "--sglang-custom-pull-weights-pre-read-hook", "pkg.hooks:before_read",
    ], "train_async")
    assert config.cluster.num_actor_gpus == 8
    assert config.cluster.rollout_num_gpus == 8
    assert config.weights.update_weight_delta_encoding == "overwrite"
    assert config.weights.update_weight_delta_checksum == "blake3"
    assert config.weights.custom_update_weight_post_write_path == "pkg.hooks:after_write"
    assert config.rollout.max_weight_staleness == 3
    assert config.rollout.pause_generation_mode == "in_place"
    assert config.train.global_batch_size == 32
    assert config.train.hf_checkpoint == str(tmp_path)


def test_yaml_sets_flags_and_command_line_wins(tmp_path: Path) -> None:
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("rollout:\n  rollout_batch_size: 4\n  n_samples_per_prompt: 2\n"
                         "num-rollout: 7\ncluster:\n  actor_num_gpus_per_node: 2\n")
    config, _ = load_config(["--config", str(yaml_path), "--rollout-batch-size", "6"], "train_async")
    assert config.rollout.rollout_batch_size == 6
    assert config.rollout.n_samples_per_prompt == 2
    assert config.rollout.num_rollout == 7
    assert config.cluster.actor_num_gpus_per_node == 2


@pytest.mark.parametrize("yaml_text, fragment", [
    ("no_such_flag: 1\n", "unknown key 'no_such_flag'"),
    ("rollout_batch_size: many\n", "--rollout-batch-size expects int"),
    ("update_weight_delta_encoding: lz4\n", "--update-weight-delta-encoding: invalid choice 'lz4'"),
    ("colocate: maybe\n", "--colocate expects true/false"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_bad_yaml_is_rejected_with_the_key(tmp_path: Path, yaml_text: str, fragment: str) -> None:
    yaml_path = tmp_path / "bad.yaml"
    yaml_path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        load_config(["--config", str(yaml_path)], "train_async")
    assert fragment in str(info.value)


def test_missing_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_config(["--config", str(tmp_path / "absent.yaml")], "train")


@pytest.mark.parametrize("extra, entry, flags", [
    (["--colocate"], "train", ("--update-weight-transfer-mode", "--colocate")),
    (["--prefill-num-servers", "1"], "train_async", ("--update-weight-transfer-mode", "--prefill-num-servers")),
])
def test_disk_delta_rejects_unsupported_modes(tmp_path: Path, extra, entry, flags) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(disk_delta(tmp_path) + extra, entry)
    assert set(flags) <= set(info.value.flags)
    for flag_name in flags:
        assert flag_name in str(info.value)


@pytest.mark.parametrize("missing, default", [("--update-weight-disk-dir", "weight-updates"),
                                              ("--update-weight-local-checkpoint-dir", "rollout-checkpoints")])
def test_disk_delta_directories_default_into_the_run_dir(tmp_path: Path, missing: str, default: str) -> None:
    argv = disk_delta(tmp_path)
    index = argv.index(missing)
    del argv[index:index + 2]
    config, _ = load_config(argv + ["--run-dir", str(tmp_path / "run")], "train_async")
    attr = missing.removeprefix("--").replace("-", "_")
    assert getattr(config.weights, attr) == str(tmp_path / "run" / default)


def test_run_dir_defaults_to_a_timestamp_under_runs() -> None:
    config, _ = load_config([], "train_async")
    assert config.tracking.run_dir.startswith("runs/") and len(config.tracking.run_dir) > len("runs/")


def test_disk_delta_requires_local_hf_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--hf-checkpoint 'Qwen/Qwen3-4B' is not a local directory"):
        load_config(DISK_DELTA + ["--hf-checkpoint", "Qwen/Qwen3-4B"], "train_async")
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        load_config(DISK_DELTA, "train_async")
    # a checkpoint that will be created at start-up is accepted
    config, _ = load_config(DISK_DELTA + ["--hf-checkpoint", str(tmp_path / "new"),
                                          "--hf-checkpoint-init", "tiny-qwen3"], "train_async")
    assert config.train.hf_checkpoint_init == "tiny-qwen3"


def test_train_async_rejects_colocate() -> None:
    with pytest.raises(ConfigError, match="--colocate") as info:
        load_config(["--colocate"], "train_async")
    assert info.value.flags == ("--colocate",)
    config, _ = load_config(["--colocate", "--train-backend", "fsdp"], "train")  # colocation offloads fsdp trainers
    assert config.cluster.colocate


@pytest.mark.parametrize("argv, fragment", [
    (["--rollout-external"], "--rollout-external requires --rollout-external-engine-addrs"),
    (["--rollout-external", "--rollout-external-engine-addrs", "10.0.0.1"], "'10.0.0.1'"),
    (["--rollout-external", "--rollout-external-engine-addrs", "h:1", "h:99999"], "'h:99999'"),
    (["--rollout-external", "--rollout-external-engine-addrs", "a" * 400 + ":1"],
     "engine address too long: 402 characters, at most 300"),
    (["--rollout-external-engine-addrs", "h:1"], "needs --rollout-external"),
    (["--rollout-external", "--rollout-external-engine-addrs", "h:1", "--rollout-service-url", "http://x"],
     "different topologies"),
    (["--rollout-external", "--rollout-external-engine-addrs", "h:1", "--rollout-node-resource", "rollout"],
     "--rollout-node-resource places the engines this job launches; with --rollout-external"),
])
def test_external_engine_addresses(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, "train_async")
    assert fragment in str(info.value)


def test_unknown_choice_and_bad_values() -> None:
    with pytest.raises(ConfigError, match="invalid choice"):
        load_config(["--update-weight-transfer-mode", "carrier-pigeon"], "train_async")
    with pytest.raises(ConfigError, match="--pause-generation-mode"):
        load_config(["--pause-generation-mode", "freeze"], "train_async")
    with pytest.raises(ConfigError, match="--n-samples-per-prompt must be >= 1"):
        load_config(["--n-samples-per-prompt", "0"], "train_async")
    with pytest.raises(ConfigError, match="--custom-update-weight-post-write-path"):
        load_config(["--custom-update-weight-post-write-path", "not a hook"], "train_async")


def test_batch_sizes_must_divide() -> None:
    with pytest.raises(ConfigError, match="--global-batch-size"):
        load_config(["--rollout-batch-size", "3", "--n-samples-per-prompt", "3", "--global-batch-size", "4"],
                    "train_async")


def test_parse_host_port() -> None:
    assert parse_host_port("10.0.1.10:30000") == ("10.0.1.10", 30000)
    assert parse_host_port("engine-0.svc:8000") == ("engine-0.svc", 8000)
    assert parse_host_port("[::1]:30000") == ("::1", 30000)
    for bad in ("10.0.1.10", ":30000", "host:0", "host:port", "http://h:1"):
        with pytest.raises(ValueError):
            parse_host_port(bad)


@pytest.mark.parametrize("argv, named", [
    (["--rollout-service-url", "http://gw:8000"], "--update-weight-transfer-mode"),
    (["--rollout-service-url", "http://gw:8000", "--update-weight-transfer-mode", "disk-delta",
      "--hf-checkpoint", "/tmp"], "--update-weight-disk-dir"),
    (["--rollout-service-url", "gw:8000", "--update-weight-transfer-mode", "disk-delta", "--hf-checkpoint", "/tmp",
      "--update-weight-disk-dir", "/tmp/store"], "must look like"),
])
def test_service_topology_needs_a_store(argv, named) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(argv, "train_async")


def test_sglang_passthrough_reaches_the_config() -> None:
    config, _ = load_config(["--sglang-mem-fraction-static", "0.8", "--sglang-enable-metrics",
                             "--sglang-custom-pull-weights-pre-read-hook", "m:f", "--rollout-batch-size", "4"],
                            "train_async")
    assert config.sglang_args == {"mem-fraction-static": "0.8", "enable-metrics": True}
    assert config.weights.sglang_custom_pull_weights_pre_read_hook == "m:f"  # the job's own flag
    assert config.rollout.rollout_batch_size == 4
