"""Megatron MoE without processes: expert/router conversion rules per EP layout, miles' MoE flags
against config.json, the EP layout checks, and the routing-replay taps. Pure torch and config."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from qwen3_shapes import hf_tensors

from miles_disagg.config.loader import load_config
from miles_disagg.trainer.megatron.convert import ModelShape, param_rules, to_hf, to_megatron
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

MOE = ModelShape(num_layers=3, hidden_size=8, ffn_hidden_size=12, num_attention_heads=4, num_query_groups=2,
                 head_dim=3, vocab_size=10, max_position_embeddings=64, rope_theta=1e6, norm_eps=1e-6,
                 tied_embeddings=False, num_experts=4, moe_topk=2, moe_ffn_hidden_size=6, norm_topk_prob=True,
                 sparse_layers=(True, False, True))


def moe_hf_tensors(shape: ModelShape) -> dict[str, torch.Tensor]:
    return hf_tensors(shape, torch.bfloat16)


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("grouped", [False, True])
def test_moe_round_trip_is_byte_identical_for_every_ep_layout(ep: int, grouped: bool) -> None:
    hf = moe_hf_tensors(MOE)
    rules = param_rules(MOE, range(3), pre_process=True, post_process=True, ep_size=ep, grouped_experts=grouped)
    back = {}
    per_rank: dict[int, set[str]] = {}
    for rule in rules:
        tp = 1 if rule.is_expert else 2  # dense parts split over TP 2; experts whole on their EP rank
        shards = [to_megatron(rule, hf, MOE, r, tp) for r in range(tp)]
        back.update(to_hf(rule, shards, MOE))
        if rule.is_expert:
            assert rule.megatron not in per_rank.setdefault(rule.ep_owner, set()), "one name per expert on its rank"
            per_rank[rule.ep_owner].add(rule.megatron)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert back[name].view(torch.uint8).equal(tensor.view(torch.uint8)), name
    assert sorted(per_rank) == list(range(ep))
    # every EP rank holds the same local parameter names (2 sparse layers x its experts x fc1/fc2)
    assert len({frozenset(names) for names in per_rank.values()}) == 1
    assert all(len(names) == 2 * 2 * (4 // ep) for names in per_rank.values())


def test_moe_rule_names() -> None:
    all_rules = param_rules(MOE, range(1), pre_process=False, post_process=False, ep_size=2)
    rules = {r.megatron: r for r in all_rules if r.ep_owner in (None, 1)}  # EP rank 1's own parameters
    router = rules["decoder.layers.0.mlp.router.weight"]
    assert router.hf == ("model.layers.0.mlp.gate.weight",) and router.kind == "dup" and not router.is_expert
    fc1 = rules["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # global expert 3
    assert fc1.hf == ("model.layers.0.mlp.experts.3.gate_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight")
    assert fc1.ep_owner == 1
    assert rules["decoder.layers.0.pre_mlp_layernorm.weight"].hf == ("model.layers.0.post_attention_layernorm.weight",)
    grouped = {r.megatron for r in param_rules(MOE, range(1), pre_process=False, post_process=False,
                                               grouped_experts=True)}
    assert "decoder.layers.0.mlp.experts.linear_fc1.weight3" in grouped
    # TE fuses the dense layer's pre-MLP norm into linear_fc1, but an MoE layer keeps it apart
    fused = {r.megatron for r in param_rules(MOE, range(2), pre_process=False, post_process=False, fused_norms=True)}
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in fused
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in fused


def hf_moe_config(**overrides) -> SimpleNamespace:
    values = dict(model_type="qwen3_moe", num_hidden_layers=4, hidden_size=8, intermediate_size=12,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=2, vocab_size=10, max_position_embeddings=64,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=6, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3])
    values.update(overrides)
    return SimpleNamespace(**values)


def test_shape_follows_hf_sparse_rule_and_checks_ep() -> None:
    shape = ModelShape.from_hf_config(hf_moe_config())
    assert shape.sparse_layers == (False, True, False, False)  # (i + 1) % 2 == 0, minus mlp_only_layers
    shape.check_parallel(1, 1, 8)
    with pytest.raises(ConfigError, match="--expert-model-parallel-size 3 does not divide the model's experts"):
        shape.check_parallel(1, 1, 3)
    dense = ModelShape.from_hf_config(hf_moe_config(model_type="qwen3", num_experts=0))
    with pytest.raises(ConfigError, match="dense model"):
        dense.check_parallel(1, 1, 2)


def write_config(directory: Path, **overrides) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3MoeForCausalLM"], **vars(hf_moe_config(**overrides))}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("argv", [
    ["--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "6"],
    ["--moe-layer-freq", "[0, 1, 0, 0]", "--moe-router-score-function", "softmax"],
    ["--moe-layer-freq", "([0]*1+[1]*1)*1+[0]*2", "--rotary-percent", "1.0", "--moe-router-topk-scaling-factor", "1"],
    ["--no-moe-router-pre-softmax"],
])
def test_moe_architecture_flags_that_match_config_json(tmp_path: Path, argv: list[str]) -> None:
    hf = write_config(tmp_path / "m")
    load_config(["--hf-checkpoint", str(hf), *argv], "train_async")


@pytest.mark.parametrize("argv, named", [
    (["--num-experts", "64"], "--num-experts 64 does not match"),
    (["--moe-router-topk", "8"], "--moe-router-topk 8 does not match"),
    (["--moe-layer-freq", "1"], "--moe-layer-freq"),
    (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq"),
    (["--moe-layer-freq", "[1]*100000*100000"], "too large"),
    (["--moe-layer-freq", "[[1]]"], "--moe-layer-freq"),
    (["--moe-router-pre-softmax"], "norm_topk_prob true"),
    (["--moe-shared-expert-intermediate-size", "16"], "--moe-shared-expert-intermediate-size 16 does not match"),
    (["--expert-model-parallel-size", "3", "--actor-num-gpus-per-node", "3"], "does not divide the 8 experts"),
])
def test_moe_flags_that_disagree_exit_with_the_flag_named(tmp_path: Path, argv: list[str], named: str) -> None:
    hf = write_config(tmp_path / "m")
    with pytest.raises(ConfigError, match=None) as info:
        load_config(["--hf-checkpoint", str(hf), *argv], "train_async")
    assert named in str(info.value)


def test_expert_parallelism_layout_rules(tmp_path: Path) -> None:
    hf = write_config(tmp_path / "m")
    load_config(["--hf-checkpoint", str(hf), "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "4"],
                "train_async")
    with pytest.raises(ConfigError, match="not a multiple of --expert-model-parallel-size 4"):
        load_config(["--hf-checkpoint", str(hf), "--expert-model-parallel-size", "4", "--actor-num-gpus-per-node", "2"],
                    "train_async")
    with pytest.raises(ConfigError, match="megatron-only"):
        load_config(["--hf-checkpoint", str(hf), "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
                     "--train-backend", "fsdp"], "train_async")
    with pytest.raises(ConfigError, match="allgather"):
        load_config(["--hf-checkpoint", str(hf), "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
                     "--moe-token-dispatcher-type", "allgather"], "train_async")
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({**vars(hf_moe_config(model_type="qwen3")), "num_experts": 0}))
    with pytest.raises(ConfigError, match="dense model"):
        load_config(["--hf-checkpoint", str(dense), "--expert-model-parallel-size", "2",
                     "--actor-num-gpus-per-node", "2"], "train_async")


# ---------------------------------------------------------------------- routing replay taps


def default_topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_tap_replays_targets_routes_free_rows_and_counts() -> None:
    from miles_disagg.trainer.megatron.moe import RouterTap

    scores = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]], requires_grad=True)
    tap = RouterTap(layer=0, target=torch.tensor([[2, 3], [3, 2], [-1, -1]]), counted=torch.tensor([True, True, True]),
                    use_target=True)
    probs, used = tap.get_replay_topk(scores, 2, None, None, default_topk)
    assert used.tolist() == [[2, 3], [3, 2], [0, 1]]  # the free row takes the router's own top-k
    assert probs.tolist() == [[2.0, 1.0], [4.0, 3.0], [4.0, 3.0]]  # the router's own scores at those experts
    probs.sum().backward()
    assert scores.grad is not None and scores.grad[0].tolist() == [0.0, 0.0, 1.0, 1.0]  # gradient reaches the router
    assert (tap.counts.rows, tap.counts.agreed, tap.counts.matched) == (2.0, 1.0, 2.0)


def test_tap_replays_the_recorded_forward_in_recomputation() -> None:
    from miles_disagg.trainer.megatron.moe import RouterTap

    tap = RouterTap(layer=0, record=True)
    _, first = tap.get_replay_topk(torch.tensor([[4.0, 3.0, 2.0, 1.0]]), 2, None, None, default_topk)
    tap.replay_recorded = True
    _, again = tap.get_replay_topk(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), 2, None, None, default_topk)  # drifted
    assert again.tolist() == first.tolist() == [[0, 1]] and not tap.recorded


def test_routing_targets_shape_and_trained_positions() -> None:
    from miles_disagg.trainer.megatron.batching import routing_targets

    sample = Sample(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[0.0, 0.0], loss_mask=[1, 0])
    sample.rollout_routed_experts = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2)
    plain = Sample(prompt_ids=[1], response_ids=[2], response_logprobs=[0.0])
    experts, counted = routing_targets([sample, plain], 6, 2, 2)
    assert experts.shape == (2, 6, 2, 2) and experts[0, :4].flatten().tolist() == list(range(16))
    assert (experts[0, 4:] == -1).all() and (experts[1] == -1).all()
    assert counted[0].tolist() == [False, False, True, False, False, False]  # position 2 predicts the trained token
    assert routing_targets([plain], 6, 2, 2) is None
    sample.rollout_routed_experts = np.zeros((5, 2, 2), dtype=np.int32)
    with pytest.raises(ValueError, match=r"shape \(5, 2, 2\), expected \(4, 2, 2\)"):
        routing_targets([sample], 6, 2, 2)
    for bad in ([3, 3], [0, 16], [-1, 2]):  # a duplicate, out of range, half free
        routed = np.zeros((4, 2, 2), dtype=np.int32)
        routed[:, :] = [0, 1]
        routed[2, 1] = bad
        sample.rollout_routed_experts = routed
        with pytest.raises(ValueError, match=r"rollout_routed_experts\[2, 1\]"):
            routing_targets([sample], 6, 2, 2, num_experts=16)
    routed[2, 1] = [-1, -1]  # a layer without experts
    routing_targets([sample], 6, 2, 2, num_experts=16)
