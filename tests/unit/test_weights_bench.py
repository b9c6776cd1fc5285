"""``bench delta`` on a tiny model: one JSON object with every documented field, exact round trip."""

from __future__ import annotations

import argparse
import json

import pytest

from miles_disagg.bench import delta


def test_bench_delta_prints_the_documented_json(capsys):
    parser = argparse.ArgumentParser()
    delta.add_arguments(parser)
    args = parser.parse_args(["--size-mb", "2", "--repeat", "1", "--json"])
    assert delta.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("model_bytes", "density", "entropy_bound_bytes", "memcpy_gbps", "wire_ratio", "encode_speedup", "decode_speedup"):
        assert result[key] > 0, key
    for codec in ("ours", "reference"):
        assert set(result[codec]) == {"wire_bytes", "encode_gbps", "decode_gbps"}
    assert result["round_trip_exact"] is True
    assert 0 < result["density"] < 0.5
    assert result["ours"]["wire_bytes"] < result["reference"]["wire_bytes"]  # byte planes: smaller on bf16 updates
    assert result["entropy_bound_bytes"] < result["reference"]["wire_bytes"]


def test_model_shapes_are_llm_like_and_sized():
    shapes = delta.model_shapes(64 * 1024 * 1024)
    names = [n for n, _ in shapes]
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    total = sum(2 * __import__("math").prod(s) for _, s in shapes)
    assert 0.8 < total / (64 * 1024 * 1024) < 1.25


def test_bench_delta_moe_prints_dense_and_moe_figures_side_by_side(capsys):
    parser = argparse.ArgumentParser()
    delta.add_arguments(parser)
    args = parser.parse_args(["--size-mb", "4", "--repeat", "1", "--json", "--moe", "--num-experts", "16",
                              "--experts-per-token", "2", "--tokens-per-step", "8"])
    assert delta.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    dense, moe = result["dense"], result["moe"]
    for figures in (dense, moe):
        for key in ("density", "wire_ratio", "wire_fraction", "encode_speedup", "decode_speedup"):
            assert figures[key] > 0, key
        assert figures["round_trip_exact"] is True
    assert moe["experts_without_tokens"] > 0
    expert_tensors = 3 * moe["experts_without_tokens"]  # gate, up and down of each untouched expert
    # (norms near 1.0 may not change either: lr 1e-5 is below bf16's resolution there, in both models)
    assert moe["tensors_skipped_fraction"] >= expert_tensors / moe["num_tensors"]
    assert moe["tensors_skipped_fraction"] > dense["tensors_skipped_fraction"]
    assert moe["density"] < dense["density"]


def test_moe_shapes_are_sized_and_named_as_on_disk():
    from miles_disagg.bench.delta_moe import moe_shapes

    shapes = moe_shapes(64 * 1024 * 1024, 32)
    names = [n for n, _ in shapes]
    assert "model.layers.2.mlp.experts.31.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    total = sum(2 * __import__("math").prod(s) for _, s in shapes)
    assert 0.75 < total / (64 * 1024 * 1024) < 1.3


def test_bench_delta_densities_measures_every_codec_side_by_side(capsys):
    parser = argparse.ArgumentParser()
    delta.add_arguments(parser)
    args = parser.parse_args(["--densities", "--density-targets", "0.5", "20", "--size-mb", "2", "--repeat", "1", "--json"])
    assert delta.run(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["round_trip_exact"] is True and [r["target_percent"] for r in result["densities"]] == [0.5, 20]
    assert set(result["targets_met"]) == {"wire_at_most_smaller_peer", "wire_at_most_0.85x_in_0.3_5_percent",
                                          "encode_at_least_1.5x_reference"}
    low, high = result["densities"]
    assert 0.3 < low["density"] / 0.005 < 1.7 and 0.3 < high["density"] / 0.2 < 1.7
    for row in (low, high):
        for codec in ("ours", "reference", "sparse"):
            assert row[codec]["wire_bytes"] > 0 and row[codec]["encode_gbps"] > 0 and row[codec]["decode_gbps"] > 0
        assert 0 < row["entropy_bound_fraction"] < row["reference"]["wire_fraction"]
        assert row["wire_vs_smaller_peer"] == pytest.approx(
            row["ours"]["wire_bytes"] / min(row["reference"]["wire_bytes"], row["sparse"]["wire_bytes"]))
        assert row["wire_vs_smaller_peer"] < 1  # ours is smaller than both peers on these deltas
    assert "sparse" in low["ours_tensor_encodings"] and "xor" in high["ours_tensor_encodings"]
