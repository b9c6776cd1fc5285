"""The trainer group: one Ray actor per rank in the trainer's bundles, called in lockstep.

A rank that dies during a call (its process killed, its node gone) ends the call at once with
:class:`~miles_disagg.types.TrainerLost` naming the rank, rather than a bare Ray error or a
wait on the surviving ranks' collective: ``--max-trainer-restarts`` restarts the group on
that error (``loop/trainer_restart.py``), and without it the run ends with one line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_disagg.config.actors import TrainerGroupConfig
from miles_disagg.remote import WATCH_INTERVAL_S, Pending, run_watches
from miles_disagg.trainer.shares import split_for_steps
from miles_disagg.trainer.placement import Placement
from miles_disagg.samples import Sample
from miles_disagg.types import FailRun, TrainerLost

if TYPE_CHECKING:
    from miles_disagg.trainer.results import TrainResult
    from miles_disagg.weights.publisher import PublishResult

RANK_PING_TIMEOUT_S = 10.0
"""After a failed call, how long each rank gets to answer a ping before it counts as alive but
busy (a rank that died answers at once with Ray's actor-death error)."""


class TrainerGroup:
    """``world_size`` TrainerRank actors; every call fans out to all ranks and waits for all."""

    def __init__(self, placement: Placement, config: TrainerGroupConfig):
        import ray

        from miles_disagg.net.netbind import worker_runtime_env
        from miles_disagg.trainer.actor import TrainerRank

        self.train_config = config.train
        positions = placement.layout.trainer
        self.world_size = len(positions)
        self.node_ids = [placement.site(pos)["node_id"] for pos in positions]
        gpus = 0.4 if config.colocated else 0.8
        remote_cls = ray.remote(TrainerRank)
        self.ranks = [
            remote_cls.options(num_cpus=0.5, num_gpus=gpus, scheduling_strategy=placement.strategy(pos),
                               runtime_env=worker_runtime_env({"OMP_NUM_THREADS": "1"}))
            .remote(rank, self.world_size, config)
            for rank, pos in enumerate(positions)
        ]
        self.run_id: str | None = None
        self.dist_address: str | None = None
        """Rank 0's torch.distributed rendezvous ``host:port`` (once set up)."""

    def setup(self, run_id: str | None = None, delta_filter: str = "none", place_timeout_s: float | None = None) -> dict:
        """Join torch.distributed, build the backend, and (disk-delta) capture the publisher's
        baseline; ``run_id`` continues that run's version stream (a resumed run);
        ``delta_filter``: the resolved ``--update-weight-delta-filter``; ``place_timeout_s``: how
        long rank 0 may take to be placed and answer (None: no limit) before ``FailRun``."""
        master_addr, master_port = self._wait([self.ranks[0].address.remote()], place_timeout_s)[0]
        self.dist_address = f"{master_addr}:{master_port}"
        infos = self._wait([r.setup.remote(master_addr, master_port, run_id, delta_filter) for r in self.ranks])
        self.run_id = infos[0]["run_id"]
        return infos[0]

    def set_rollout_engines(self, urls: list[str]) -> None:
        self._wait([r.set_rollout_engines.remote(list(urls)) for r in self.ranks])

    def set_delta_filter(self, delta_filter: str) -> None:
        self._wait([r.set_delta_filter.remote(delta_filter) for r in self.ranks])

    def weight_checksums(self, algorithm: str) -> dict[str, str]:
        """What the engines must serve now, per tensor (collective; disk-delta: every rank's share
        merged; broadcast: rank 0's answer)."""
        merged: dict[str, str] = {}
        for part in self._wait([r.weight_checksums.remote(algorithm) for r in self.ranks]):
            merged.update(part or {})
        return merged

    def train(self, samples: list[Sample]) -> TrainResult:
        """Train on one rollout's samples (whole global batches); the metrics of each optimizer
        step over the global batch (every rank computes the same; rank 0's are returned)."""
        per_step = split_for_steps(samples, self.train_config.global_batch_size or len(samples), self.world_size,
                                   balance=self.train_config.balance_data)
        results = self._wait([r.train.remote([step[rank] for step in per_step]) for rank, r in enumerate(self.ranks)])
        return results[0]

    def publish(self) -> PublishResult:
        """The policy as the next version (every rank writes its share; rank 0 commits)."""
        return self._wait([r.publish.remote() for r in self.ranks])[0]

    def save(self, directory: str, with_hf: bool) -> None:
        self._wait([r.save.remote(directory) for r in self.ranks])
        if with_hf:
            self._wait([r.save_hf.remote(f"{directory}/hf") for r in self.ranks])

    def load(self, directory: str) -> None:
        self._wait([r.load.remote(directory) for r in self.ranks])

    def publish_full(self) -> PublishResult:
        return self._wait([r.publish_full.remote() for r in self.ranks])[0]

    def latest_published(self) -> dict | None:
        return self._wait([self.ranks[0].latest_published.remote()])[0]

    def tensor_meta(self) -> dict[str, list]:
        return self._wait([r.tensor_meta.remote() for r in self.ranks])[0]

    def broadcast_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there (the weight-update group's rendezvous)."""
        return self._wait([self.ranks[0].address.remote()])[0]

    def init_broadcast_group(self, master_addr: str, master_port: int, world_size: int, group_name: str) -> Pending:
        """Start joining (the engines must join concurrently)."""
        return Pending([r.init_broadcast_group.remote(master_addr, master_port, world_size, group_name)
                        for r in self.ranks])

    def broadcast_weights(self) -> Pending:
        """Start the broadcast (the engines receive concurrently)."""
        return Pending([r.broadcast_weights.remote() for r in self.ranks])

    # --colocate: the ranks take turns with the engines on the same GPUs

    def offload(self, params: bool = True, optimizer: bool = True) -> dict[str, int]:
        """Every rank moves its optimizer state and/or parameters off the device; rank 0's sizes."""
        import ray

        return ray.get([r.offload.remote(params, optimizer) for r in self.ranks])[0]

    def onload(self) -> None:
        import ray

        ray.get([r.onload.remote() for r in self.ranks])

    def push_weights(self, engine_urls: list[str], version: int) -> dict:
        """Hand the policy to the colocated engines by reference (rank 0 sends; the others gather)."""
        import ray

        return ray.get([r.push_weights.remote(engine_urls, version) for r in self.ranks])[0]

    def tensor_bytes(self) -> dict[str, bytes]:
        return self._wait([r.named_tensor_bytes.remote() for r in self.ranks])[0]

    def write_store_probe(self):
        """Disk-delta: rank 0 (the publisher) writes a probe into the version store; see
        :mod:`miles_disagg.weights.probe`."""
        return self._wait([self.ranks[0].write_store_probe.remote()])[0]

    def remove_store_probe(self, probe) -> None:
        self._wait([self.ranks[0].remove_store_probe.remote(probe)])

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)

    # ------------------------------------------------------------------ waiting on the ranks

    def _wait(self, refs: list, timeout_s: float | None = None) -> list:
        """The calls' results, running the run's watches (``remote.run_watches``) while waiting;
        the first call to fail ends the wait: with ``TrainerLost`` when a rank died, else with
        its own error (a rank that raised, e.g. on bad input, is no trainer failure)."""
        import time

        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            if deadline is not None and time.monotonic() > deadline:
                raise FailRun(f"the trainer ranks did not answer within {timeout_s:.0f}s (a rank's bundle waits for "
                              "a node with the resources it needs)")
            ready, pending = ray.wait(pending, num_returns=1, timeout=WATCH_INTERVAL_S)
            run_watches()
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:
                    failure = self._failure(exc, refs.index(ref))
                    if failure is exc:
                        raise
                    raise failure from exc
        return ray.get(refs)

    def _failure(self, exc: Exception, call_index: int) -> Exception:
        """``TrainerLost`` naming the dead rank when ``exc`` came from (or after) a rank's death."""
        from miles_disagg.remote import is_actor_death

        dead = self.dead_ranks()
        if not dead and is_actor_death(exc):
            dead = [call_index]  # the call itself reports its actor's death
        if not dead:
            return exc
        rank = dead[0]
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        node = self.node_ids[rank] if rank < len(self.node_ids) else None
        return TrainerLost(f"trainer rank {rank} died" + (f" (node {node[:8]})" if node else "") +
                           f": {type(exc).__name__}: {cause}", rank=rank, node_id=node or "")

    def dead_ranks(self) -> list[int]:
        """The ranks whose actor is dead (a ping answered with Ray's actor-death error); a rank
        busy past ``RANK_PING_TIMEOUT_S`` counts as alive."""
        import ray
        from ray.exceptions import RayActorError

        pings = [r.__ray_ready__.remote() for r in self.ranks]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=RANK_PING_TIMEOUT_S)
        dead = []
        for rank, ping in enumerate(pings):
            if ping not in ready:
                continue
            try:
                ray.get(ping)
            except RayActorError:
                dead.append(rank)
        return dead
