"""The trainer backend port: what one trainer rank does, whatever the parallelism library.

A backend lives inside one trainer rank (a Ray actor) after ``torch.distributed`` is
initialized. Every method is collective: all ranks call it in the same order.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Iterator

import torch

from miles_disagg.trainer.results import TrainResult
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError


class TrainerBackend(ABC):
    """One rank of a policy trainer."""

    @abstractmethod
    def train(self, steps: list[list[Sample]]) -> TrainResult:
        """One rollout's optimizer steps; ``steps[i]`` is this rank's share of global batch i.

        The behaviour policy's logprobs are recomputed with the current weights before the
        first step, so the first step's ratio is 1. Per-token advantages are computed from each
        sample's ``advantage`` (``trainer.advantages``). Each step's loss and metrics are
        normalised over the whole global batch (every data-parallel rank), so every rank returns
        the same ``TrainResult``.
        """

    @abstractmethod
    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The policy as canonical HF-named CPU tensors in the checkpoint's dtypes (collective)."""

    def publish_share(self, sizes: dict[str, int]) -> frozenset[str]:
        """The HF tensors this rank publishes (sharded disk-delta; ``sizes``: every tensor's bytes).
        Default: every rank gathers every tensor, so they are split by size (balanced, the same on
        every rank)."""
        from miles_disagg.weights.shares import assign_by_size

        return assign_by_size(sizes, self.world_size)[self.rank]  # type: ignore[attr-defined]

    def share_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """At least this rank's ``publish_share`` as HF-named CPU tensors (collective; tensors of other
        shares may come too, and are skipped by the publisher)."""
        return self.named_tensors()

    @abstractmethod
    def save_checkpoint(self, directory: str) -> None:
        """Model, optimizer and RNG state into ``directory`` (collective; every rank writes its
        part). Model and optimizer are saved in a layout independent of the number of ranks
        and of the parallel layout; see ``trainer/rank_state.py`` for the directory."""

    @abstractmethod
    def load_checkpoint(self, directory: str) -> None:
        """Restore what ``save_checkpoint`` wrote, also when a different number of ranks (or
        another parallel layout of the same backend) wrote it (collective)."""

    def offload_targets(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """The module and optimizer ``--colocate`` moves off the device between trainings."""
        raise ConfigError(f"--colocate offloading is not implemented for {type(self).__name__}; "
                          "use --train-backend fsdp", ("--colocate", "--train-backend"))
