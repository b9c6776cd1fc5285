"""The gpu_check ``moe`` section's own logic on CPU: the engine's routing turned into samples and
checked (from answers encoded as the contract says), and the reason it gives where this tree has
no MoE model family."""

from __future__ import annotations

import base64

import numpy as np

from miles_disagg.bench import gpu_moe
from miles_disagg.bench.gpu_sections import Shapes

SHAPE = {"num_hidden_layers": 2, "num_experts_per_tok": 2, "num_experts": 4}


def _answer(prompt_len: int, new: int, layer0_dense: bool = True) -> dict:
    rows = np.array([[[(p + k) % 4, (p + k + 1) % 4] for k in range(2)] for p in range(prompt_len + new - 1)],
                    dtype=np.int32)
    if layer0_dense:
        rows[:, 0] = -1
    return {"output_ids": [5] * new, "meta_info": {"output_token_logprobs": [[-0.1, 5, None]] * new,
                                                   "routed_experts": base64.b64encode(rows.tobytes()).decode()}}


def test_the_engines_routing_becomes_checked_samples():
    groups, report = gpu_moe._samples_with_routing([3] * 6, [_answer(6, 3), _answer(6, 3)], SHAPE)
    assert [s.rollout_routed_experts.shape for s in groups[0].samples] == [(8, 2, 2)] * 2
    assert report == {"routed_rows_per_sample": 8, "sparse_layers": 1, "experts_in_range": True,
                      "top_k_distinct": True, "experts_used": 4}


def test_without_the_moe_model_family_the_section_says_why(tmp_path, monkeypatch):
    import miles_disagg.models.tiny_qwen3 as tiny

    def dense_only(out_dir, *, hidden_size=64, dtype="float32"):
        raise AssertionError("not called")

    monkeypatch.setattr(tiny, "make_tiny_qwen3", dense_only)
    report = gpu_moe.section_moe(Shapes.for_run(cpu=True), tmp_path)
    assert report == {"skipped": "this tree has no qwen3_moe model family (make_tiny_qwen3 takes no num_experts)"}
