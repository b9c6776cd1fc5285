"""The pure placement layout: trainer bundles first, engines next, colocate shares."""

from __future__ import annotations

import pytest

from miles_disagg.config.components import ClusterConfig
from miles_disagg.trainer.placement import plan_layout
from miles_disagg.types import ConfigError


def test_default_layout_separates_trainer_and_engines() -> None:
    layout = plan_layout(ClusterConfig(actor_num_nodes=1, actor_num_gpus_per_node=4, rollout_num_gpus=4,
                                       rollout_num_gpus_per_engine=2))
    assert layout.num_bundles == 8
    assert layout.trainer == (0, 1, 2, 3)
    assert layout.engines == ((4, 5), (6, 7))


def test_colocated_layout_shares_the_trainer_bundles() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True))
    assert layout.num_bundles == 2 and layout.trainer == (0, 1) and layout.engines == ((0,), (1,))


def test_external_rollout_reserves_only_the_trainer() -> None:
    layout = plan_layout(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=4), external_rollout=True)
    assert layout.num_bundles == 2 and layout.engines == ()


def test_engines_must_be_whole() -> None:
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine"):
        plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=3, rollout_num_gpus_per_engine=2))
    with pytest.raises(ConfigError, match="--colocate"):
        plan_layout(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2, colocate=True))


def test_with_num_gpus_per_node_an_engine_may_not_span_two_nodes() -> None:
    from miles_disagg.trainer.placement import node_of

    fits = plan_layout(ClusterConfig(actor_num_gpus_per_node=4, rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
                                     num_gpus_per_node=4))
    assert [[node_of(p, 4) for p in engine] for engine in fits.engines] == [[(1, 0), (1, 1)], [(1, 2), (1, 3)]]
    with pytest.raises(ConfigError, match="rollout engine 1 would span nodes \\[0, 1\\]") as info:
        plan_layout(ClusterConfig(actor_num_gpus_per_node=3, rollout_num_gpus=4, rollout_num_gpus_per_engine=2,
                                  num_gpus_per_node=6))
    assert "--num-gpus-per-node" in info.value.flags
    # without the flag the node size is unknown: the placement checks the real nodes at start-up
    plan_layout(ClusterConfig(actor_num_gpus_per_node=3, rollout_num_gpus=4, rollout_num_gpus_per_engine=2))
