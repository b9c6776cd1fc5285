"""The trainer group: one Ray actor per rank in the trainer's bundles, called in lockstep."""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_disagg.config.actors import TrainerGroupConfig
from miles_disagg.remote import Pending, wait_for
from miles_disagg.trainer.shares import split_for_steps
from miles_disagg.trainer.placement import Placement
from miles_disagg.types import Sample

if TYPE_CHECKING:
    from miles_disagg.trainer.results import TrainResult
    from miles_disagg.weights.publisher import PublishResult


class TrainerGroup:
    """``world_size`` TrainerRank actors; every call fans out to all ranks and waits for all."""

    def __init__(self, placement: Placement, config: TrainerGroupConfig):
        import ray

        from miles_disagg.netbind import worker_runtime_env
        from miles_disagg.trainer.actor import TrainerRank

        self.train_config = config.train
        positions = placement.layout.trainer
        self.world_size = len(positions)
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

    def setup(self, run_id: str | None = None, delta_filter: str = "none") -> dict:
        """Join torch.distributed, build the backend, and (disk-delta) capture the publisher's
        baseline; ``run_id`` continues that run's version stream (a resumed run);
        ``delta_filter``: the resolved ``--update-weight-delta-filter``."""
        master_addr, master_port = wait_for([self.ranks[0].address.remote()])[0]
        self.dist_address = f"{master_addr}:{master_port}"
        infos = wait_for([r.setup.remote(master_addr, master_port, run_id, delta_filter) for r in self.ranks])
        self.run_id = infos[0]["run_id"]
        return infos[0]

    def set_rollout_engines(self, urls: list[str]) -> None:
        import ray

        ray.get([r.set_rollout_engines.remote(list(urls)) for r in self.ranks])

    def set_delta_filter(self, delta_filter: str) -> None:
        import ray

        ray.get([r.set_delta_filter.remote(delta_filter) for r in self.ranks])

    def weight_checksums(self, algorithm: str) -> dict[str, str]:
        """What the engines must serve now, per tensor (collective; disk-delta: every rank's share
        merged; broadcast: rank 0's answer)."""
        import ray

        merged: dict[str, str] = {}
        for part in ray.get([r.weight_checksums.remote(algorithm) for r in self.ranks]):
            merged.update(part or {})
        return merged

    def train(self, samples: list[Sample]) -> TrainResult:
        """Train on one rollout's samples (whole global batches); the metrics of each optimizer
        step over the global batch (every rank computes the same; rank 0's are returned)."""
        per_step = split_for_steps(samples, self.train_config.global_batch_size or len(samples), self.world_size,
                                   balance=self.train_config.balance_data)
        results = wait_for([r.train.remote([step[rank] for step in per_step]) for rank, r in enumerate(self.ranks)])
        return results[0]

    def publish(self) -> PublishResult:
        """The policy as the next version (every rank writes its share; rank 0 commits)."""
        return wait_for([r.publish.remote() for r in self.ranks])[0]

    def save(self, directory: str, with_hf: bool) -> None:
        wait_for([r.save.remote(directory) for r in self.ranks])
        if with_hf:
            wait_for([r.save_hf.remote(f"{directory}/hf") for r in self.ranks])

    def load(self, directory: str) -> None:
        wait_for([r.load.remote(directory) for r in self.ranks])

    def publish_full(self) -> PublishResult:
        return wait_for([r.publish_full.remote() for r in self.ranks])[0]

    def latest_published(self) -> dict | None:
        return wait_for([self.ranks[0].latest_published.remote()])[0]

    def tensor_meta(self) -> dict[str, list]:
        return wait_for([r.tensor_meta.remote() for r in self.ranks])[0]

    def broadcast_address(self) -> tuple[str, int]:
        """Rank 0's node address and a free port there (the weight-update group's rendezvous)."""
        return wait_for([self.ranks[0].address.remote()])[0]

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
        return wait_for([r.named_tensor_bytes.remote() for r in self.ranks])[0]

    def write_store_probe(self):
        """Disk-delta: rank 0 (the publisher) writes a probe into the version store; see
        :mod:`miles_disagg.weights.probe`."""
        return wait_for([self.ranks[0].write_store_probe.remote()])[0]

    def remove_store_probe(self, probe) -> None:
        wait_for([self.ranks[0].remove_store_probe.remote(probe)])

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
