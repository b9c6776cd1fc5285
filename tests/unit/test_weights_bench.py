"""``bench delta`` on a tiny model: one JSON object with every documented field, exact round trip."""

from __future__ import annotations

import argparse
import json

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
