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
