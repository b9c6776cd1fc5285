"""The trainer backend port: what one trainer rank does, whatever the parallelism library.

A backend lives inside one trainer rank (a Ray actor) after ``torch.distributed`` is
initialized. Every method is collective: all ranks call it in the same order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from miles_disagg.config.components import TrainConfig
from miles_disagg.types import ConfigError, Sample


class TrainerBackend(ABC):
    """One rank of a policy trainer."""

    @abstractmethod
    def train(self, steps: list[list[Sample]]) -> dict[str, float]:
        """One rollout's optimizer steps; ``steps[i]`` is this rank's share of global batch i.

        The behaviour policy's logprobs are recomputed with the current weights before the
        first step, so the first step's ratio is 1. Returns this rank's mean metrics
        (``train/loss``, ``train/pg_clipfrac``, ``train/ppo_kl``, ``train/grad_norm``,
        ``train/entropy``, ``train/train_rollout_logprob_abs_diff``, ...).
        """

    @abstractmethod
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy as canonical HF-named CPU tensors in the checkpoint's dtypes (collective)."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Model, optimizer and RNG state for a training checkpoint."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned."""


class MetricMeans:
    """Running means of named metrics (per micro-batch or per optimizer step)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, key: str, value: float) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + float(value)
        self._counts[key] = self._counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / self._counts[k] for k in self._sums}


def make_backend(config: TrainConfig, hf_dir: str, *, rank: int, world_size: int,
                 temperature: float = 1.0, initial_checkpoint: tuple[str, str] | None = None) -> TrainerBackend:
    """The ``--train-backend`` for this rank (megatron-core is imported only when chosen);
    ``initial_checkpoint``: ``(path, flag)`` of a Megatron torch_dist checkpoint to start from."""
    if config.train_backend == "fsdp":
        from miles_disagg.trainer.fsdp import FSDPBackend

        if initial_checkpoint is not None:
            raise ConfigError(f"{initial_checkpoint[1]} {initial_checkpoint[0]} is a Megatron torch_dist checkpoint: "
                              "use --train-backend megatron", (initial_checkpoint[1], "--train-backend"))
        return FSDPBackend(config, hf_dir, rank=rank, world_size=world_size, temperature=temperature)
    if config.train_backend == "megatron":
        from miles_disagg.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(config, hf_dir, rank=rank, world_size=world_size, temperature=temperature,
                               initial_checkpoint=initial_checkpoint)
    raise ConfigError(f"unknown --train-backend {config.train_backend!r}; expected fsdp or megatron", ("--train-backend",))
