"""A two-turn sample served by two versions replays each turn's own routing.

Turn 1 comes from an engine at version A; the tool tokens and turn 2 from an engine at version B
(other router weights), asked with ``routed_experts_start_len`` = the first position call 1 did not
run (the contract's multi-turn rule). The trainer replays the concatenated rows: every trained
position routes to the experts of the version that ran it, which differ from what version A alone
would have chosen for call 2's positions."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine_fixtures import inprocess_engine
from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.config.components import TrainConfig
from miles_disagg.models.routed_experts_wire import decode_routed_experts
from miles_disagg.samples import Sample

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def version_b(tiny_qwen3_moe_dir, tmp_path_factory):
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("version-b") / "model"
    shutil.copytree(tiny_qwen3_moe_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    generator = torch.Generator().manual_seed(11)
    for name in [n for n in tensors if n.endswith("mlp.gate.weight")]:
        tensors[name] = torch.randn(tensors[name].shape, generator=generator) * 0.5  # another routing
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _call(model_dir, input_ids: list[int], start: int, max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    with inprocess_engine(model_dir, enable_return_routed_experts=True) as (_engine, handle):
        result = handle.generate({"input_ids": input_ids, "return_routed_experts": True,
                                  "routed_experts_start_len": start,
                                  "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True,
                                                      "sampling_seed": 5}})
    return result["output_ids"], decode_routed_experts(result["meta_info"]["routed_experts"], 2, 2)


def test_each_turn_replays_the_version_that_served_it(tiny_qwen3_moe_dir, version_b):
    from miles_disagg.engines.builtin.model_runner import ModelRunner
    from miles_disagg.trainer.batches import pack
    from miles_disagg.trainer.fsdp import FSDPBackend
    from miles_disagg.trainer.fsdp_routing import RoutingShape, pack_engine_routing

    prompt, tool = [3, 4, 5, 6], [7, 8]
    turn1, rows1 = _call(tiny_qwen3_moe_dir, prompt, 0, 3)  # version A
    first = prompt + turn1
    assert rows1.shape[0] == len(first) - 1  # the last token of turn 1 never ran in call 1
    turn2, rows2 = _call(version_b, first + tool, len(first) - 1, 3)  # version B, from that token on
    tokens = first + tool + turn2
    routed = np.concatenate([rows1, rows2])
    assert routed.shape == (len(tokens) - 1, 2, 2)

    version_a_alone = ModelRunner(tiny_qwen3_moe_dir).full_routed_experts(tokens)[:-1].numpy()
    assert (routed[: len(first) - 1] == version_a_alone[: len(first) - 1]).all()
    assert (routed[len(first) - 1:] != version_a_alone[len(first) - 1:]).any()  # B routes otherwise

    response = tokens[len(prompt):]
    sample = Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-2.0] * len(response),
                    loss_mask=[1] * len(turn1) + [0] * len(tool) + [1] * len(turn2), rollout_routed_experts=routed)
    backend = FSDPBackend(TrainConfig(lr=1e-2, global_batch_size=1, micro_batch_size=1,
                                      use_rollout_routing_replay=True), str(tiny_qwen3_moe_dir), rank=0, world_size=1)
    batch = pack([sample])
    engine = pack_engine_routing([sample], len(tokens), RoutingShape.of(backend.module))
    with torch.no_grad():
        used = backend._token_logprobs(backend.model, batch, False, engine)[2].routed_experts[0, :-1].numpy()
    assert (used == routed).all()
    assert backend.train([[sample]]).steps[0]["train/routing_replay_match"] == 1.0
