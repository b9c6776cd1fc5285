"""HF <-> megatron conversion (names, fused layouts, TP shards, PP stages) and the megatron batching helpers.

Pure tensor code: no torch.distributed, no megatron-core needed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from qwen3_shapes import hf_tensors

from miles_disagg.trainer.megatron.batching import (
    cp_merge, cp_split, fixed_size_batches, make_micro_batch, token_budget_batches)
from miles_disagg.trainer.megatron.convert import ModelShape, param_rules, stage_layers, to_hf, to_megatron
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

SHAPE = ModelShape(num_layers=4, hidden_size=8, ffn_hidden_size=12, num_attention_heads=4, num_query_groups=2,
                   head_dim=3, vocab_size=10, max_position_embeddings=64, rope_theta=1e6, norm_eps=1e-6,
                   tied_embeddings=False)


def round_trip(hf: dict[str, torch.Tensor], shape: ModelShape, tp: int, pp: int) -> dict[str, torch.Tensor]:
    out = {}
    for stage in range(pp):
        rules = param_rules(shape, stage_layers(shape.num_layers, pp, stage), pre_process=stage == 0,
                            post_process=stage == pp - 1)
        for rule in rules:
            if rule.export:
                shards = [to_megatron(rule, hf, shape, rank, tp) for rank in range(tp)]
                out.update(to_hf(rule, shards, shape))
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_byte_identical(tp: int, pp: int, dtype: torch.dtype) -> None:
    hf = hf_tensors(SHAPE, dtype)
    back = round_trip(hf, SHAPE, tp, pp)
    assert set(back) == set(hf)
    for name, tensor in hf.items():
        assert back[name].dtype == dtype and back[name].shape == tensor.shape, name
        assert raw_bytes(back[name]) == raw_bytes(tensor), name


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_qkv_is_fused_per_query_group_and_sharded_by_group() -> None:
    hf = hf_tensors(SHAPE)
    rule = next(r for r in param_rules(SHAPE, range(1), pre_process=False, post_process=False) if r.kind == "qkv")
    q, k, v = (hf[name] for name in rule.hf)
    d, per_group = SHAPE.head_dim, SHAPE.heads_per_group
    fused = to_megatron(rule, hf, SHAPE, 0, 1)
    rows_per_group = (per_group + 2) * d
    for g in range(SHAPE.num_query_groups):
        block = fused[g * rows_per_group:(g + 1) * rows_per_group]
        assert block[:per_group * d].equal(q[g * per_group * d:(g + 1) * per_group * d])
        assert block[per_group * d:(per_group + 1) * d].equal(k[g * d:(g + 1) * d])
        assert block[(per_group + 1) * d:].equal(v[g * d:(g + 1) * d])
    assert to_megatron(rule, hf, SHAPE, 1, 2).equal(fused[rows_per_group:])  # TP rank 1 holds group 1


def test_gated_shard_is_gate_rows_then_up_rows() -> None:
    hf = hf_tensors(SHAPE)
    rule = next(r for r in param_rules(SHAPE, range(1), pre_process=False, post_process=False) if r.kind == "gated")
    gate, up = (hf[name] for name in rule.hf)
    half = SHAPE.ffn_hidden_size // 2
    shard = to_megatron(rule, hf, SHAPE, 1, 2)
    assert shard[:half].equal(gate[half:]) and shard[half:].equal(up[half:])


def test_row_parallel_splits_columns_and_norms_are_duplicated() -> None:
    hf = hf_tensors(SHAPE)
    rules = {r.megatron: r for r in param_rules(SHAPE, range(1), pre_process=False, post_process=False)}
    proj = rules["decoder.layers.0.self_attention.linear_proj.weight"]
    assert to_megatron(proj, hf, SHAPE, 1, 2).equal(hf["model.layers.0.self_attn.o_proj.weight"][:, 6:])
    norm = rules["decoder.layers.0.self_attention.q_layernorm.weight"]
    assert norm.kind == "dup" and to_megatron(norm, hf, SHAPE, 1, 2).equal(hf["model.layers.0.self_attn.q_norm.weight"])


def test_pipeline_stages_use_local_layer_names_and_tied_copies_are_not_exported() -> None:
    tied = ModelShape(**{**SHAPE.__dict__, "tied_embeddings": True})
    last = param_rules(tied, stage_layers(4, 2, 1), pre_process=False, post_process=True)
    assert last[0].megatron == "decoder.layers.0.input_layernorm.weight" and last[0].hf == ("model.layers.2.input_layernorm.weight",)
    output = [r for r in last if r.megatron == "output_layer.weight"]
    assert output and output[0].hf == ("model.embed_tokens.weight",) and not output[0].export
    single = param_rules(tied, range(4), pre_process=True, post_process=True)
    assert "output_layer.weight" not in {r.megatron for r in single}  # shares the embedding's weight
    assert set(round_trip(hf_tensors(tied), tied, 2, 2)) == set(hf_tensors(tied))


def test_transformer_engine_names_fuse_the_norms() -> None:
    rules = param_rules(SHAPE, range(1), pre_process=False, post_process=False, fused_norms=True)
    names = {r.megatron: r.hf[0] for r in rules}
    assert names["decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"] == "model.layers.0.input_layernorm.weight"
    assert names["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == "model.layers.0.post_attention_layernorm.weight"


def qwen3_config(**overrides) -> SimpleNamespace:
    values = dict(model_type="qwen3", num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=104,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return SimpleNamespace(**{**values, **overrides})


def test_shape_from_hf_config_reads_rope_theta_and_rejects_what_it_cannot_convert() -> None:
    shape = ModelShape.from_hf_config(qwen3_config())
    assert shape.rope_theta == 1e6 and shape.num_query_groups == 2 and shape.heads_per_group == 2
    legacy = ModelShape.from_hf_config(qwen3_config(rope_parameters=None, rope_theta=5e5))  # transformers 4.x
    assert legacy.rope_theta == 5e5
    for bad in (qwen3_config(model_type="llama"), qwen3_config(attention_bias=True),
                qwen3_config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})):
        with pytest.raises(ConfigError):
            ModelShape.from_hf_config(bad)


def test_parallel_sizes_must_divide_heads_groups_vocab_and_layers() -> None:
    shape = ModelShape.from_hf_config(qwen3_config())
    shape.check_parallel(2, 2)
    with pytest.raises(ConfigError, match="key/value heads"):
        shape.check_parallel(4, 1)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size 4 .* layers"):
        shape.check_parallel(1, 4)


# ---------------------------------------------------------------------- batching


def sample(prompt_len: int, response_len: int) -> Sample:
    return Sample(prompt_ids=list(range(1, prompt_len + 1)), response_ids=list(range(50, 50 + response_len)),
                  response_logprobs=[-1.0] * response_len, advantage=1.0)


def test_token_budget_batches_keep_order_and_budget() -> None:
    samples = [sample(3, 2), sample(3, 3), sample(2, 2), sample(10, 10), sample(1, 1)]
    batches = token_budget_batches(samples, max_tokens=12)
    assert [s for b in batches for s in b] == samples
    assert [len(b) for b in batches] == [2, 1, 1, 1]  # lengths 5, 6 fit as 2 x 6; a third is 3 x 6 > 12
    assert all(len(b) * max(len(s.prompt_ids) + len(s.response_ids) for s in b) <= 12 for b in batches if len(b) > 1)
    assert fixed_size_batches(samples, 2) == [samples[:2], samples[2:4], samples[4:]]
    with pytest.raises(ValueError):
        token_budget_batches(samples, 0)


def test_micro_batch_pads_to_multiple_and_points_at_predicting_positions() -> None:
    mb = make_micro_batch([sample(3, 2), sample(1, 3)], pad_id=0, seq_multiple=4)
    assert mb.seq_len == 8  # longest is 5 -> padded to 8
    assert mb.targets[0, :4].tolist() == [2, 3, 50, 51] and mb.targets[0, -1] == 0
    assert mb.response_positions.tolist() == [[2, 3, 4], [0, 1, 2]]
    for row, positions in enumerate(mb.response_positions.tolist()):
        real = mb.packed.response_mask[row].bool().tolist()
        for j, position in enumerate(positions):
            if real[j]:
                assert mb.targets[row, position] == mb.packed.response_ids[row, j]


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_split_is_load_balanced_and_merge_inverts_it(cp: int) -> None:
    tensor = torch.arange(2 * 12).reshape(2, 12)
    parts = [cp_split(tensor, cp, rank) for rank in range(cp)]
    assert cp_merge(parts).equal(tensor)
    if cp == 2:
        assert parts[0][0].tolist() == [0, 1, 2, 9, 10, 11] and parts[1][0].tolist() == [3, 4, 5, 6, 7, 8]
