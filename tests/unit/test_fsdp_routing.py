"""Packing the engine's routing for the fsdp trainer: positions, padding, and hostile arrays refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.fsdp_routing import RoutingCounts, RoutingShape, equal_sets, pack_engine_routing, trained_positions
from miles_disagg.samples import Sample
from miles_disagg.types import InvalidInput

SHAPE = RoutingShape(layers=2, top_k=2, sparse_layers=(0, 1), num_experts=4)


def _sample(prompt: int, response: int, routed=None) -> Sample:
    return Sample(prompt_ids=list(range(1, prompt + 1)), response_ids=list(range(1, response + 1)),
                  response_logprobs=[0.0] * response, rollout_routed_experts=routed)


def test_rows_are_placed_at_their_positions_and_the_rest_routes_freely():
    a = np.arange(4 * 2 * 2, dtype=np.int32).reshape(4, 2, 2) % 4  # 3 prompt + 2 response - 1
    packed = pack_engine_routing([_sample(3, 2, a), _sample(2, 1)], 5, SHAPE)
    assert packed.shape == (2, 5, 2, 2)
    assert torch.equal(packed[0, :4], torch.as_tensor(a).long())
    assert (packed[0, 4] == -1).all() and (packed[1] == -1).all()
    assert pack_engine_routing([_sample(2, 1)], 3, SHAPE) is None


def test_routing_from_a_json_round_trip_is_accepted():
    nested = (np.ones((3, 2, 2), dtype=np.int32)).tolist()  # the debug-rollout-data JSONL holds lists
    assert pack_engine_routing([_sample(2, 2, nested)], 4, SHAPE)[0, :3].eq(1).all()


@pytest.mark.parametrize("routed, match", [
    (np.zeros((5, 2, 2), dtype=np.int32), "has shape \\(5, 2, 2\\)"),
    (np.zeros((3, 2, 3), dtype=np.int32), "has shape"),
    (np.full((3, 2, 2), 4, dtype=np.int32), "outside \\[-1, 4\\)"),
    (np.full((3, 2, 2), -7, dtype=np.int32), "outside"),
])
def test_hostile_routing_is_refused_naming_the_problem(routed, match):
    with pytest.raises(InvalidInput, match=match):
        pack_engine_routing([_sample(2, 2, routed)], 4, SHAPE)


def test_counts_compare_sets_at_trained_positions_only():
    sample = _sample(2, 2, np.array([[[0, 1]] * 2, [[2, 3]] * 2, [[1, 0]] * 2], dtype=np.int32))
    sample.loss_mask = [1, 0]
    batch = pack([sample])
    assert trained_positions(batch)[0].tolist() == [False, True, False, False]
    engine = pack_engine_routing([sample], 4, SHAPE)
    own = engine.clone()
    own[0, 1, 0] = torch.tensor([3, 2])  # the same set in another order: agrees
    own[0, 1, 1] = torch.tensor([0, 1])  # another set: disagrees
    counts = RoutingCounts()
    counts.add(batch, SHAPE, engine, used=engine, own=own, replaying_engine=True)
    assert (counts.agreement, counts.compared, counts.replay_match, counts.replayed) == (1, 2, 2, 2)
    assert equal_sets(torch.tensor([1, 2]), torch.tensor([2, 1]))
