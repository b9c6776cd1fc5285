"""Start and stop everything a run needs: Ray, placement, trainer group, engines, router, rollout.

``Job.start(config)`` brings the pieces up in dependency order and ``Job.stop()`` tears them
down in reverse; a failure while starting stops what was already started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from miles_disagg.config.actors import EngineManagerConfig, RolloutManagerConfig, TrainerGroupConfig
from miles_disagg.config.components import RunConfig
from miles_disagg.tracking import status
from miles_disagg.types import ConfigError

if TYPE_CHECKING:
    from miles_disagg.engines.handle import EngineManagerHandle
    from miles_disagg.rollout.handle import RolloutManagerHandle
    from miles_disagg.trainer.group import TrainerGroup
    from miles_disagg.trainer.placement import Placement

RAY_TMPDIR_ENV = "MILES_DISAGG_RAY_TMPDIR"


@dataclass
class Job:
    """The running pieces of one run; each is None when the run does not use it."""

    config: RunConfig
    placement: Placement | None = None
    trainer: TrainerGroup | None = None
    engines: EngineManagerHandle | None = None  # managed or attached engines (not the service topology)
    rollout: RolloutManagerHandle | None = None
    router_url: str | None = None  # the router, or the rollout service's endpoint
    run_id: str | None = None
    tensor_meta: dict | None = None  # broadcast mode: what the engines receive
    _owns_ray: bool = False
    _data_position: int = 0

    @classmethod
    def start(cls, config: RunConfig, *, with_trainer: bool = True, with_engines: bool = True,
              run_id: str | None = None, data_position: int = 0) -> "Job":
        """``run_id``/``data_position``: a resumed run's version stream and prompts consumed."""
        job = cls(config, run_id=run_id)
        job._data_position = data_position
        try:
            job._start(with_trainer, with_engines)
        except BaseException:
            job.stop()
            raise
        return job

    def _start(self, with_trainer: bool, with_engines: bool) -> None:
        from miles_disagg.trainer.placement import create_placement, plan_layout

        cfg = self.config
        external = cfg.rollout.rollout_external or bool(cfg.rollout.rollout_service_url) or not with_engines
        layout = plan_layout(cfg.cluster, external_rollout=external)
        self._owns_ray = init_ray(layout.num_bundles)
        status(f"placement: {layout.num_bundles} GPU bundles (trainer {list(layout.trainer)}, "
               f"engines {[list(e) for e in layout.engines] or 'attached'})")
        self.placement = create_placement(layout)
        if with_trainer:
            self._start_trainer()
        if with_engines:
            self._start_engines()
        colocated = with_trainer and with_engines and cfg.cluster.colocate
        if colocated:  # weights go by reference (loop/colocate.py), not over a broadcast group
            from miles_disagg.loop import colocate

            colocate.start(self)
        elif with_trainer and with_engines and cfg.weights.update_weight_transfer_mode == "broadcast":
            self._join_broadcast_group()

    def _start_trainer(self) -> None:
        from miles_disagg.trainer.group import TrainerGroup

        self.trainer = TrainerGroup(self.placement, TrainerGroupConfig.from_run(self.config))
        info = self.trainer.setup(self.run_id)
        self.run_id = info.get("run_id")
        status(f"trainer: {self.trainer.world_size} rank(s), {info['backend']}, ready in {info['setup_s']:.1f}s")

    def _start_engines(self) -> None:
        from miles_disagg.engines.handle import EngineManagerHandle

        if self.config.rollout.rollout_service_url:
            self._connect_service()
            return
        self.engines = EngineManagerHandle(EngineManagerConfig.from_run(self.config), self.placement)
        self.engines.start()
        self.router_url = self.engines.router_url
        status(f"engines: {len(self.engines.engine_urls)} behind the router at {self.router_url}")
        self._start_rollout()

    def _connect_service(self) -> None:
        """Service topology: no engine handle at all; one endpoint, versions from the store."""
        import httpx

        url = self.config.rollout.rollout_service_url.rstrip("/")
        try:
            httpx.get(f"{url}/health", timeout=10, trust_env=False).raise_for_status()
        except httpx.HTTPError as exc:
            raise ConfigError(f"--rollout-service-url {url}: not answering /health ({exc})",
                              ("--rollout-service-url",)) from None
        self.router_url = url
        status(f"rollout service at {url}; versions go through {self.config.weights.update_weight_disk_dir}")
        self._start_rollout()

    def _start_rollout(self) -> None:
        from miles_disagg.rollout.handle import RolloutManagerHandle

        self.rollout = RolloutManagerHandle(RolloutManagerConfig.from_run(self.config, self.router_url),
                                            data_position=self._data_position)

    def _join_broadcast_group(self) -> None:
        addr, port = self.trainer.broadcast_address()
        world = self.engines.broadcast_world_size()
        joining = self.trainer.init_broadcast_group(addr, port, world, "miles_disagg_weight_update")
        self.engines.init_broadcast_group(addr, port).result()
        joining.result()
        self.tensor_meta = self.trainer.tensor_meta()
        status(f"weights: broadcast group of the trainer and {world - 1} engine(s) at {addr}:{port}")

    def stop(self) -> None:
        import ray

        for step in (self._stop_rollout, self._stop_engines, self._stop_trainer):
            try:
                step()
            except Exception as exc:  # keep tearing down the rest
                status(f"shutdown: {type(exc).__name__}: {exc}")
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _stop_rollout(self) -> None:
        if self.rollout is not None:
            self.rollout.stop(timeout_s=30)

    def _stop_engines(self) -> None:
        if self.engines is not None:
            self.engines.shutdown(timeout_s=60)

    def _stop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()


def init_ray(num_bundles: int) -> bool:
    """Connect to ``RAY_ADDRESS`` if set, else start a local Ray; on a machine without CUDA
    the local Ray gets ``num_bundles`` logical GPUs. Returns whether this process started it."""
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
        return True
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else num_bundles
    tmp = os.environ.get(RAY_TMPDIR_ENV)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private local cluster
    ray.init(num_cpus=max(8, os.cpu_count() or 1), num_gpus=num_gpus, include_dashboard=False,
             logging_level="WARNING", _temp_dir=str(Path(tmp).resolve()) if tmp else None,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}})
    return True
