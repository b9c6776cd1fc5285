"""miles launch flags: accepted with miles' meaning, derived as miles derives them, or refused
with one line that names the flag, why, and what to use instead."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from miles_disagg.config import load_config
from miles_disagg.config.loader import config_to_namespace, config_to_yaml, load_launch
from miles_disagg.config.miles_flags import REFUSED_FLAGS
from miles_disagg.types import ConfigError

QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2560, "intermediate_size": 9728, "max_position_embeddings": 40960,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
# miles' scripts/models/qwen3-4B.sh
QWEN3_4B_MODEL_ARGS = [
    "--swiglu", "--num-layers", "36", "--hidden-size", "2560", "--ffn-hidden-size", "9728",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels", "128",
    "--qk-layernorm",
]


@pytest.fixture(scope="module")
def qwen3_4b(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("Qwen3-4B")
    (directory / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    return directory


def test_qwen3_4b_model_args_agree_with_its_config(qwen3_4b: Path) -> None:
    config, _ = load_config(["--hf-checkpoint", str(qwen3_4b), *QWEN3_4B_MODEL_ARGS], "train_async")
    assert config.model.num_layers == 36 and config.model.qk_layernorm is True
    assert config.train.train_backend == "megatron"  # a miles line names no backend: Megatron, as in miles


@pytest.mark.parametrize("argv, config_says", [
    (["--swiglu", "--no-swiglu"], "hidden_act 'silu'"),
    (["--num-layers", "28"], "num_hidden_layers 36"),
    (["--hidden-size", "4096"], "hidden_size 2560"),
    (["--ffn-hidden-size", "12288"], "intermediate_size 9728"),
    (["--num-attention-heads", "16"], "num_attention_heads 32"),
    (["--no-group-query-attention"], "num_key_value_heads 8 of 32 heads"),
    (["--num-query-groups", "4"], "num_key_value_heads 8"),
    (["--kv-channels", "64"], "head_dim 128"),
    (["--no-use-rotary-position-embeddings"], "rope_theta set"),
    (["--position-embedding-type", "learned_absolute"], "position embeddings 'rope'"),
    (["--rotary-base", "10000"], "rope_theta 1000000.0"),
    (["--no-disable-bias-linear"], "attention_bias False"),
    (["--add-qkv-bias"], "attention_bias false"),
    (["--normalization", "LayerNorm"], "normalization 'RMSNorm'"),
    (["--norm-epsilon", "1e-5"], "rms_norm_eps 1e-06"),
    (["--no-qk-layernorm"], "model_type 'qwen3'"),
    (["--vocab-size", "151680"], "vocab_size 151936"),
    (["--max-position-embeddings", "32768"], "max_position_embeddings 40960"),
    (["--untie-embeddings-and-output-weights"], "tie_word_embeddings True"),
])
def test_each_architecture_mismatch_exits_naming_the_flag_and_both_values(qwen3_4b: Path, argv, config_says) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(["--hf-checkpoint", str(qwen3_4b), *argv], "train_async")
    flag = argv[-2] if not argv[-1].startswith("--") else argv[-1]
    flag = flag.replace("--no-", "--")
    assert flag in info.value.flags and "--hf-checkpoint" in info.value.flags
    message = str(info.value)
    assert message.startswith(flag) and config_says in message, message


def test_architecture_flags_need_a_checkpoint_with_a_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="give --hf-checkpoint"):
        load_config(["--num-layers", "36"], "train_async")
    with pytest.raises(ConfigError, match="has no config.json"):
        load_config(["--num-layers", "36", "--hf-checkpoint", str(tmp_path)], "train_async")
    # a checkpoint created at start-up is checked once it exists (launcher), not before
    load_config(["--num-layers", "36", "--hf-checkpoint", str(tmp_path / "new"), "--hf-checkpoint-init",
                 "tiny-qwen3"], "train_async")


@pytest.mark.parametrize("flag", sorted(REFUSED_FLAGS))
def test_each_refused_miles_flag_says_why_and_what_instead(flag: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config([flag, "x"] if flag not in ("--keep-old-actor", "--offload", "--offload-train",
                                                "--offload-rollout", "--partial-rollout") else [flag], "train_async")
    message = str(info.value)
    assert info.value.flags == (flag,)
    assert message.startswith(f"{flag} is a miles flag that does not apply here: ") and "; " in message
    assert "unrecognized" not in message


def test_refused_miles_flag_in_yaml(tmp_path: Path) -> None:
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("rollout:\n  rollout_batch_size: 4\nkeep_old_actor: true\n")
    with pytest.raises(ConfigError, match="--keep-old-actor is a miles flag"):
        load_config(["--config", str(yaml_path)], "train_async")


@pytest.mark.parametrize("argv, named", [
    (["--megatron-to-hf-mode", "bridge"], "--megatron-to-hf-mode"),
    (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size"),
    (["--moe-token-dispatcher-type", "flex"], "--moe-token-dispatcher-type"),
    (["--moe-router-load-balancing-type", "sinkhorn"], "--moe-router-load-balancing-type"),
])
def test_values_miles_accepts_but_this_launcher_cannot_run(argv, named) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, "train_async")
    assert named in info.value.flags and "is a miles flag that does not apply here" in str(info.value)


@pytest.mark.parametrize("flag, value", [("--attention-dropout", "0.0"), ("--hidden-dropout", "0.1"),
                                         ("--attention-softmax-in-fp32", None),
                                         ("--accumulate-allreduce-grads-in-fp32", None),
                                         ("--attention-backend", "flash"), ("--moe-grouped-gemm", None),
                                         ("--moe-permute-fusion", None), ("--moe-token-dispatcher-type", "alltoall"),
                                         ("--moe-router-load-balancing-type", "none"), ("--moe-aux-loss-coeff", "0"),
                                         ("--moe-router-dtype", "fp32"), ("--moe-token-drop-policy", "probs")])
def test_megatron_transformer_flags_are_refused_on_fsdp(flag: str, value: str | None) -> None:
    argv = [flag] + ([value] if value else [])
    config, _ = load_config(argv, "train_async")  # megatron (the default) takes them
    with pytest.raises(ConfigError) as info:
        load_config(argv + ["--train-backend", "fsdp"], "train_async")
    assert flag in info.value.flags and "--train-backend fsdp" in str(info.value)


@pytest.mark.parametrize("argv, entry, named", [
    (["--fully-async"], "train", "--fully-async"),
    (["--pause-generation-mode", "abort"], "train_async", "--pause-generation-mode"),
    (["--rollout-external", "--rollout-external-engine-addrs", "h:1", "--prefill-num-servers", "1"], "train_async",
     "--prefill-num-servers"),
    (["--rollout-external", "--rollout-external-engine-addrs", "h:1", "--sglang-config", "x.yaml"], "train_async",
     "--sglang-config"),
    (["--use-rollout-logprobs", "--use-tis"], "train_async", "--use-rollout-logprobs"),
    (["--use-miles-router", "--router", "sglang"], "train_async", "--use-miles-router"),
    (["--sglang-router-policy", "round_robin"], "train_async", "--sglang-router-policy"),
])
def test_combinations_miles_refuses(argv, entry, named) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(argv, entry)
    assert named in info.value.flags and named in str(info.value)


def test_fully_async_is_what_train_async_does() -> None:
    config, _ = load_config(["--fully-async"], "train_async")
    assert config.rollout.fully_async


def test_num_epoch_derives_num_rollout_from_the_prompts(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": str(i)}) + "\n" for i in range(10)) + "\n")
    config, _ = load_config(["--num-epoch", "3", "--prompt-data", str(data), "--rollout-batch-size", "4"],
                            "train_async")
    assert config.rollout.num_rollout == 3 * 10 // 4
    config, _ = load_config(["--num-epoch", "3", "--num-rollout", "2", "--prompt-data", str(data),
                             "--rollout-batch-size", "4"], "train_async")
    assert config.rollout.num_rollout == 2  # miles: --num-epoch is ignored when --num-rollout is given
    with pytest.raises(ConfigError, match="--prompt-data"):
        load_config(["--num-epoch", "1", "--rollout-batch-size", "4"], "train_async")


def test_num_steps_per_rollout_sets_the_global_batch() -> None:
    config, _ = load_config(["--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
                             "--num-steps-per-rollout", "2"], "train_async")
    assert config.train.global_batch_size == 16
    with pytest.raises(ConfigError, match="--global-batch-size 8 disagrees"):
        load_config(["--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--num-steps-per-rollout", "2",
                     "--global-batch-size", "8"], "train_async")


def test_ci_test_turns_on_the_weight_update_check_unless_disabled() -> None:
    assert load_config(["--ci-test"], "train_async")[0].ci.check_weight_update_equal
    assert not load_config(["--ci-test", "--ci-disable-weight-update-checker"], "train_async")[0] \
        .ci.check_weight_update_equal
    assert not load_config(["--ci-test", "--debug-rollout-only"], "train")[0].ci.check_weight_update_equal


def test_sglang_flags_miles_consumes_never_reach_sglang() -> None:
    config, _ = load_config(["--sglang-router-port", "31000", "--sglang-server-concurrency", "16",
                             "--sglang-mem-fraction-static", "0.7", "--rollout-num-gpus", "4",
                             "--rollout-num-gpus-per-engine", "2", "--actor-num-gpus-per-node", "4"], "train_async")
    assert config.sglang_args == {"mem-fraction-static": "0.7"}
    assert config.rollout.sglang_router_port == 31000
    assert config.rollout.rollout_concurrency == 16 * 2  # per engine x 2 engines


def test_the_wandb_key_is_never_printed() -> None:
    config, _ = load_config(["--wandb-key", "s3cr3t", "--wandb-team", "lab"], "train_async")
    assert config.tracking.wandb_key == "s3cr3t"
    text = config_to_yaml(config)
    assert "s3cr3t" not in text and "wandb_key: <redacted>" in text and "wandb_team: lab" in text


def test_print_config_and_dry_run_are_modes() -> None:
    assert load_launch(["--dry-run"], "train_async")[1] == "dry-run"
    assert load_launch(["--print-config"], "train_async")[1] == "print-config"
    with pytest.raises(ConfigError):
        load_launch(["--dry-run", "--print-config"], "train_async")


def test_miles_namespace_carries_every_flag_under_miles_names() -> None:
    config, _ = load_config(["--update-weight-disk-dir", "/s", "--sglang-mem-fraction-static", "0.7"], "train_async")
    args = config_to_namespace(config)
    assert args.update_weight_disk_dir == "/s" and args.sglang_mem_fraction_static == "0.7"
    assert args.rollout_batch_size is None and args.entry == "train_async"


def test_dotted_hook_paths_are_accepted() -> None:
    config, _ = load_config(["--custom-update-weight-post-write-path", "pkg.hooks.after_write"], "train_async")
    assert config.weights.custom_update_weight_post_write_path == "pkg.hooks.after_write"
