"""Configuration: miles' flag names, typed per-component configs, YAML, validation.

    config, print_only = load_config(argv, entry="train_async")
    config.cluster / config.rollout / config.weights / config.train / config.tracking
"""

from miles_disagg.config.components import (
    ClusterConfig,
    RolloutConfig,
    RunConfig,
    TrackingConfig,
    WeightUpdateConfig,
)
from miles_disagg.config.training import TrainConfig
from miles_disagg.config.loader import build_parser, config_to_dict, config_to_yaml, load_config
from miles_disagg.config.validate import parse_host_port, validate

__all__ = [
    "ClusterConfig", "RolloutConfig", "RunConfig", "TrackingConfig", "TrainConfig", "WeightUpdateConfig",
    "build_parser", "config_to_dict", "config_to_yaml", "load_config", "parse_host_port", "validate",
]
