"""Trainer rank processes that host one group after another, for the tests that build many groups.

A trainer rank is a Ray worker that imports torch (and megatron-core): about 4-5 CPU-seconds
before it builds a tiny model in a tenth of that. A test module that compares many small groups
(flag sets, layouts, backends, 1 rank against 2) starts :class:`RankPool` once: its rank
processes live for the module, and each group the module builds is a real
:class:`~miles_disagg.trainer.group.TrainerGroup` (or
:class:`~miles_disagg.trainer.critic_group.CriticGroup`) whose ranks are the first ranks of the
pool. Before it becomes rank ``r`` of a new group, a pooled rank drops the group it hosted: its
backend and publisher, megatron's parallel state and every torch.distributed process group. What
differs from a fresh group is only the process: the backend, the optimizer and the process
groups are built anew, from the same seeds.

Workers cannot import the test directory: the pool's actor classes travel by value.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
from typing import Any, Callable, Iterator

from miles_disagg.config.actors import CriticGroupConfig, TrainerGroupConfig
from miles_disagg.trainer.actor import TrainerRank
from miles_disagg.trainer.critic_group import CriticGroup, CriticRank
from miles_disagg.trainer.group import TrainerGroup

READY_TIMEOUT_S = 300.0


def drop_process_state() -> None:
    """Forget megatron's parallel state and destroy every torch.distributed process group of this
    process (what a new group's ranks need before they join theirs)."""
    if "megatron.core.parallel_state" in sys.modules:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    gc.collect()


class PooledTrainerRank(TrainerRank):
    """A :class:`TrainerRank` whose process hosts one trainer group after another."""

    def __init__(self) -> None:
        self.backend = self.publisher = None

    def become(self, rank: int, world_size: int, config: TrainerGroupConfig) -> None:
        """Drop the group hosted so far; be rank ``rank`` of ``world_size`` with ``config`` (not set up)."""
        self.release()
        TrainerRank.__init__(self, rank, world_size, config)

    def release(self) -> None:
        if self.publisher is not None and hasattr(self.publisher, "close"):
            self.publisher.close()
        self.backend = self.publisher = None
        drop_process_state()

    def run(self, function: Callable, *args: Any) -> Any:
        """``function(*args)`` in this process, with no group hosted (it may start its own)."""
        self.release()
        return function(*args)


class PooledCriticRank(CriticRank):
    """A :class:`CriticRank` whose process hosts one critic group after another."""

    def __init__(self) -> None:
        self.backend = None

    def become(self, rank: int, world_size: int, config: CriticGroupConfig) -> None:
        self.release()
        CriticRank.__init__(self, rank, world_size, config)

    def release(self) -> None:
        self.backend = None
        drop_process_state()


class PooledTrainerGroup(TrainerGroup):
    """A :class:`TrainerGroup` over ranks that are already running (a pool's): built without
    starting actors; ``shutdown`` leaves the ranks to the pool that lent them."""

    def __init__(self, ranks: list, config: TrainerGroupConfig):  # noqa: D107 - not TrainerGroup's: no new actors
        import ray

        self.train_config = config.train
        self.world_size = len(ranks)
        self.node_ids = [ray.get_runtime_context().get_node_id()] * len(ranks)
        self.ranks = list(ranks)
        self.run_id = None
        self.dist_address = None
        ray.get([r.become.remote(i, len(ranks), config) for i, r in enumerate(ranks)], timeout=READY_TIMEOUT_S)
        self.setup_info: dict | None = None

    def setup(self, *args: Any, **kwargs: Any) -> dict:
        """``TrainerGroup.setup``; its answer also kept as ``setup_info``."""
        self.setup_info = super().setup(*args, **kwargs)
        return self.setup_info

    def shutdown(self) -> None:
        """Nothing: the pool that lent the ranks takes them back (``RankPool.give_back``)."""


class PooledCriticGroup(CriticGroup):
    """A :class:`CriticGroup` over a pool's running ranks (see :class:`PooledTrainerGroup`)."""

    def __init__(self, ranks: list, config: CriticGroupConfig):  # noqa: D107 - not CriticGroup's: no new actors
        import ray

        self.config = config
        self.world_size = len(ranks)
        self.ranks = list(ranks)
        ray.get([r.become.remote(i, len(ranks), config) for i, r in enumerate(ranks)], timeout=READY_TIMEOUT_S)
        self.setup_info: dict | None = None

    def setup(self) -> dict:
        """``CriticGroup.setup``; its answer also kept as ``setup_info``."""
        self.setup_info = super().setup()
        return self.setup_info

    def shutdown(self) -> None:
        """Nothing: the pool that lent the ranks takes them back (``RankPool.give_back``)."""


def release(ranks: list) -> list:
    """Every live rank of ``ranks`` drops its group; returns the ranks that are dead (killed by a test)."""
    import ray

    dead = []
    for rank in ranks:
        try:
            ray.get(rank.release.remote(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.RayActorError:
            dead.append(rank)
    return dead


class RankPool:
    """Rank processes of one kind (``"trainer"`` or ``"critic"``) started once, reused by every group.
    Groups alive at the same time get disjoint ranks; a rank that died is replaced by a new process."""

    KINDS = {"trainer": (PooledTrainerRank, PooledTrainerGroup), "critic": (PooledCriticRank, PooledCriticGroup)}

    def __init__(self, kind: str = "trainer"):
        import ray
        from ray import cloudpickle

        from miles_disagg.net.netbind import worker_runtime_env

        cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
        rank_cls, self.group_cls = self.KINDS[kind]
        # as the product starts its ranks (one OpenMP thread), minus the GPU bundle
        self.remote_cls = ray.remote(rank_cls).options(num_cpus=0.5, num_gpus=0,
                                                       runtime_env=worker_runtime_env({"OMP_NUM_THREADS": "1"}))
        self.ranks: list = []
        self.busy: list = []

    def take(self, world_size: int) -> list:
        """``world_size`` ranks no live group holds (more are started when the pool holds fewer)."""
        free = [r for r in self.ranks if all(r is not b for b in self.busy)]
        while len(free) < world_size:
            rank = self.remote_cls.remote()
            self.ranks.append(rank)
            free.append(rank)
        taken = free[:world_size]
        self.busy.extend(taken)
        return taken

    def give_back(self, ranks: list) -> None:
        """The group of ``ranks`` has ended: its live ranks are free again, its dead ones dropped."""
        dead = release(ranks)
        self.busy = [b for b in self.busy if all(b is not r for r in ranks)]
        self.ranks = [r for r in self.ranks if all(r is not d for d in dead)]

    @contextlib.contextmanager
    def group(self, world_size: int, config, **setup: Any) -> Iterator:
        """A set-up group of ``world_size`` pooled ranks with ``config`` (``setup``: the group's
        ``setup`` arguments); its ranks given back on exit."""
        ranks = self.take(world_size)
        try:
            group = self.group_cls(ranks, config)
            group.setup(**setup)
            yield group
        finally:
            self.give_back(ranks)

    def run(self, function: Callable, *args: Any) -> Any:
        """``function(*args)`` in a free rank's process, no group hosted (a torch.distributed
        it starts is its own to end)."""
        import ray
        from ray import cloudpickle

        module = sys.modules.get(getattr(function, "__module__", ""), None)
        if module is not None and not module.__name__.startswith("miles_disagg"):
            cloudpickle.register_pickle_by_value(module)  # a test module's function
        ranks = self.take(1)
        try:
            return ray.get(ranks[0].run.remote(function, *args))
        finally:
            self.give_back(ranks)

    def discard(self, ranks: list) -> None:
        """Kill ``ranks`` (a test ended their group mid-call): the pool starts new processes in their place."""
        import ray

        for rank in ranks:
            ray.kill(rank, no_restart=True)
        self.ranks = [r for r in self.ranks if all(r is not d for d in ranks)]

    def close(self) -> None:
        self.discard(list(self.ranks))
        self.busy = []


@contextlib.contextmanager
def private_ray_pool(kind: str = "trainer", num_gpus: int = 4) -> Iterator[RankPool]:
    """A private local Ray (the test modules' usual one) and a :class:`RankPool` on it."""
    import ray

    from miles_disagg.net.netbind import LOCAL_RAY_SYSTEM_CONFIG

    os.environ["RAY_AUTH_MODE"] = "disabled"
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # Ray socket paths must be short
    ray.init(num_cpus=8, num_gpus=num_gpus, include_dashboard=False, _temp_dir=tmp, logging_level="WARNING",
             _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    pool = RankPool(kind)
    try:
        yield pool
    finally:
        pool.close()
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
