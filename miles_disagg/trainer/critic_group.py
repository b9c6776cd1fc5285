"""PPO's critic as a trainer group of its own: one Ray actor per critic bundle, called in lockstep.

The critic's ranks sit in the placement's critic bundles (``Layout.critic``, after the policy's),
form their own torch.distributed group, and hold the value model and its optimizer
(:mod:`miles_disagg.trainer.critic`); they publish nothing. The driver, per rollout:

1. :meth:`CriticGroup.score` - every sample gets the critic's value of each response token
   (``trainer.critic_values``), before either group trains;
2. the policy trains on the samples (GAE advantages from those values);
3. :meth:`CriticGroup.train` - the critic trains on the same samples (GAE returns from the same
   values), started before the policy's training and waited for after it.

Saves go to their own directory (``loop/critic_checkpoint.py``). A critic rank that dies ends the run.
Torch-free on import (the driver's side); :class:`CriticRank` imports the backend on its rank.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from miles_disagg.config.actors import CriticGroupConfig
from miles_disagg.remote import Pending, wait_for
from miles_disagg.trainer.critic_values import attach_values
from miles_disagg.trainer.shares import split_for_steps
from miles_disagg.samples import Sample

if TYPE_CHECKING:
    from miles_disagg.trainer.placement import Placement
    from miles_disagg.trainer.results import TrainResult


class CriticRank:
    """One critic rank (a Ray actor); every method is collective over the critic's ranks."""

    def __init__(self, rank: int, world_size: int, config: CriticGroupConfig):
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        self.rank, self.world_size, self.config = rank, world_size, config
        self.backend = None

    def address(self) -> tuple[str, int]:
        import ray

        from miles_disagg.net.process import free_port

        return ray.util.get_node_ip_address(), free_port("0.0.0.0")

    def setup(self, master_addr: str, master_port: int) -> dict:
        import torch

        from miles_disagg.distributed import init_distributed
        from miles_disagg.trainer.critic import CriticBackend

        torch.set_num_threads(1)
        start = time.perf_counter()
        backend = init_distributed(self.rank, self.world_size, master_addr, master_port)
        self.backend = CriticBackend(self.config, rank=self.rank, world_size=self.world_size)
        return {"backend": backend, "setup_s": time.perf_counter() - start}

    def values(self, samples: list[Sample]) -> list[list[float]]:
        return self.backend.values(samples)

    def train(self, steps: list[list[Sample]]):
        return self.backend.train(steps)

    def save(self, directory: str) -> None:
        self.backend.save_checkpoint(directory)

    def load(self, directory: str) -> None:
        self.backend.load_checkpoint(directory)

    def value_head_state(self) -> dict:
        """The value head's tensors (what tests compare after a load)."""
        return self.backend.value_head_state()


class CriticGroup:
    """``len(placement.layout.critic)`` CriticRank actors; every call fans out to all ranks."""

    def __init__(self, placement: Placement, config: CriticGroupConfig):
        import ray

        from miles_disagg.net.netbind import worker_runtime_env

        self.config = config
        positions = placement.layout.critic
        if not positions:
            raise ValueError("the placement has no critic bundles (plan_layout(..., critic=True))")
        self.world_size = len(positions)
        remote_cls = ray.remote(CriticRank)
        self.ranks = [
            remote_cls.options(num_cpus=0.5, num_gpus=0.8, scheduling_strategy=placement.strategy(pos),
                               runtime_env=worker_runtime_env({"OMP_NUM_THREADS": "1"}))
            .remote(rank, self.world_size, config)
            for rank, pos in enumerate(positions)
        ]

    def setup(self) -> dict:
        """Join the critic's own torch.distributed group and build the value model on every rank."""
        master_addr, master_port = wait_for([self.ranks[0].address.remote()])[0]
        return wait_for([r.setup.remote(master_addr, master_port) for r in self.ranks])[0]

    def score(self, samples: list[Sample]) -> None:
        """Attach the critic's values to every sample (``trainer.critic_values``); equal shares per rank."""
        shares = split_for_steps(samples, len(samples), self.world_size)[0]
        answers = wait_for([r.values.remote(share) for r, share in zip(self.ranks, shares)])
        for share, values in zip(shares, answers):
            for sample, sample_values in zip(share, values, strict=True):
                attach_values(sample, sample_values)

    def train(self, samples: list[Sample]) -> Pending[TrainResult]:
        """Start training on one rollout's scored samples (whole global batches, as the policy's);
        the result (every rank's is the same) once :meth:`Pending.result` is called."""
        train = self.config.train
        per_step = split_for_steps(samples, train.global_batch_size or len(samples), self.world_size,
                                   balance=train.balance_data)
        return Pending([r.train.remote([step[rank] for step in per_step]) for rank, r in enumerate(self.ranks)])

    def save(self, directory: str) -> None:
        wait_for([r.save.remote(directory) for r in self.ranks])

    def load(self, directory: str) -> None:
        wait_for([r.load.remote(directory) for r in self.ranks])

    def value_head_state(self) -> dict:
        return wait_for([r.value_head_state.remote() for r in self.ranks])[0]

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
