"""Start and stop everything a run needs: Ray, placement, trainer group, engines, router, rollout.

``Job.start(config)`` brings the pieces up in dependency order and ``Job.stop()`` tears them
down in reverse; a failure while starting stops what was already started.

Security (:mod:`miles_disagg.net.netbind`): before anything starts, the run takes its keys (job
flags or environment; a random admin key otherwise) into its environment, from which every
process and actor it starts inherits them; its servers bind loopback unless the job spans
nodes; a Ray cluster it starts keeps Ray's token authentication on.

On a cluster (``RAY_ADDRESS``, or a driver started by ``ray job submit``) the placement may
span nodes: the control actors (engine manager, router, rollout manager) stay on the driver's
node, the version store is checked from every engine's node before training, the run
directory gets ``placement.json``. A rollout node that leaves the cluster costs capacity: its
engines are placed again when the cluster allows, and the run ends only when fewer than
``--min-rollout-engines`` serve for longer than its timeout (:mod:`miles_disagg.loop.capacity`);
a trainer node that leaves ends the run with ``NodeLost`` unless ``on_trainer_node_lost`` takes
it over (see :mod:`miles_disagg.loop.cluster`). What happened to the engines goes to the run
directory's ``engine_events.json`` when the run stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from miles_disagg.config.actors import CriticGroupConfig, EngineManagerConfig, RolloutManagerConfig, TrainerGroupConfig
from miles_disagg.config.components import RunConfig
from miles_disagg.config.critic_rules import uses_critic
from miles_disagg.loop import colocate
from miles_disagg.loop.cluster import (NodeWatch, TrainerNodeLost, placement_record, work_by_node,
                                       write_engine_events, write_placement)
from miles_disagg.loop.ray_start import init_ray
from miles_disagg.loop.waiting import still
from miles_disagg.tracking import status
from miles_disagg.types import ConfigError

if TYPE_CHECKING:
    from miles_disagg.fleet.handle import EngineManagerHandle
    from miles_disagg.rollout.handle import RolloutManagerHandle
    from miles_disagg.trainer.critic_group import CriticGroup
    from miles_disagg.trainer.group import TrainerGroup
    from miles_disagg.trainer.placement import Placement



@dataclass
class Job:
    """The running pieces of one run; each is None when the run does not use it."""

    config: RunConfig
    placement: Placement | None = None
    trainer: TrainerGroup | None = None
    critic: CriticGroup | None = None  # PPO's critic (--advantage-estimator ppo), its own trainer group
    engines: EngineManagerHandle | None = None  # managed or attached engines (not the service topology)
    rollout: RolloutManagerHandle | None = None
    router_url: str | None = None  # the router, or the rollout service's endpoint
    run_id: str | None = None
    tensor_meta: dict | None = None  # broadcast mode: what the engines receive
    initial_checkpoint: tuple[str, str] | None = None  # (path, flag): a torch_dist checkpoint the policy starts from
    data_position: int = 0  # the prompts a resumed run consumed before it started
    node_watch: NodeWatch | None = None  # registered for the job's lifetime (a trainer restart unwatches a node)
    on_trainer_node_lost: TrainerNodeLost | None = None  # the trainer-restart seam
    opd_teacher: object | None = None  # the --use-opd teacher engine the job serves (--opd-teacher-hf-checkpoint)
    _owns_ray: bool = False
    _capacity_watch: object | None = None  # the CapacityWatch, once the engines run

    @classmethod
    def start(cls, config: RunConfig, *, with_trainer: bool = True, with_engines: bool = True,
              run_id: str | None = None, data_position: int = 0,
              initial_checkpoint: tuple[str, str] | None = None,
              on_trainer_node_lost: TrainerNodeLost | None = None) -> "Job":
        """``run_id``/``data_position``: a resumed run's version stream and prompts consumed;
        ``initial_checkpoint``: the Megatron torch_dist checkpoint a fresh policy starts from;
        ``on_trainer_node_lost`` (:data:`miles_disagg.loop.cluster.TrainerNodeLost`): takes the loss
        of a trainer node over instead of ending the run (trainer restarts)."""
        job = cls(config, run_id=run_id, data_position=data_position, initial_checkpoint=initial_checkpoint,
                  on_trainer_node_lost=on_trainer_node_lost)
        try:
            job._start(with_trainer, with_engines)
        except BaseException:
            job.stop()
            raise
        return job

    def _start(self, with_trainer: bool, with_engines: bool) -> None:
        from miles_disagg.remote import add_watch
        from miles_disagg.trainer.placement import create_placement, plan_layout

        from miles_disagg.net.netbind import export_keys, run_keys

        cfg = self.config
        export_keys(run_keys(cfg.rollout.rollout_api_key, cfg.rollout.rollout_admin_api_key))
        external = cfg.rollout.rollout_external or bool(cfg.rollout.rollout_service_url) or not with_engines
        critic = with_trainer and uses_critic(cfg)
        layout = plan_layout(cfg.cluster, external_rollout=external, critic=critic)
        self._owns_ray = init_ray(layout.num_bundles)
        status(f"placement: {layout.num_bundles} GPU bundles (trainer {list(layout.trainer)}, "
               + (f"critic {list(layout.critic)}, " if critic else "")
               + f"engines {[list(e) for e in layout.engines] or 'attached'})")
        self.placement = create_placement(layout)
        if self.placement.spans_nodes:
            status(f"placement spans nodes: {_nodes_line(self.placement)}")
        self.node_watch = NodeWatch.of(self.placement, engines_replaced=self._engines_replaced(with_engines),
                                       on_trainer_node_lost=self.on_trainer_node_lost)
        add_watch(self.node_watch)
        if with_trainer:
            self._start_trainer()
        if critic:
            self._start_critic()
        if with_engines:
            self._start_engines()
        if self.engines is not None:
            from miles_disagg.loop.capacity import CapacityWatch

            self._capacity_watch = CapacityWatch(self.engines.capacity)
            add_watch(self._capacity_watch)
        colocated = with_trainer and with_engines and cfg.cluster.colocate
        if colocated:  # weights go by reference (loop/colocate.py), not over a broadcast group
            colocate.start(self.trainer)
        elif with_trainer and with_engines and cfg.weights.update_weight_transfer_mode == "broadcast":
            self._join_broadcast_group()
        sessions_url = self.rollout.session_url() if self.rollout is not None and cfg.rollout.use_session_server else None
        if sessions_url:
            status(f"session endpoint at {sessions_url}/sessions (agents' OpenAI routes under /sessions/ID/v1)")
        write_placement(cfg.tracking.run_dir, placement_record(
            self.placement, trainer_address=self.trainer.dist_address if self.trainer is not None else None,
            engines=self.engines, router_url=self.router_url, engines_attached=cfg.rollout.rollout_external,
            sessions_url=sessions_url))
        if self.engines is not None:  # after placement.json, which membership changes rewrite
            self.engines.serve_membership()  # engines may join and leave from now on (miles-disagg engines)

    def _engines_replaced(self, with_engines: bool) -> bool:
        """Whether the engine manager places a lost node's engines again (managed engines updated
        through the version store; a broadcast group cannot take a new member)."""
        cfg = self.config
        return (with_engines and not cfg.rollout.rollout_external and not cfg.rollout.rollout_service_url
                and not cfg.cluster.colocate and cfg.weights.update_weight_transfer_mode == "disk-delta")

    def _delta_filter(self, attached: list | None = None):
        from miles_disagg.fleet.plan import delta_filter_choice, resolve_backend

        cfg = self.config
        backend = None if cfg.rollout.rollout_external or cfg.rollout.rollout_service_url else \
            resolve_backend(cfg.rollout.rollout_backend)[0]
        return delta_filter_choice(cfg.weights, cfg.rollout, backend=backend,
                                   num_engines=len(self.placement.layout.engines), attached=attached)

    def _start_trainer(self, place_timeout_s: float | None = None) -> None:
        from miles_disagg.trainer.group import TrainerGroup

        status(f"starting the trainer: {len(self.placement.layout.trainer)} rank(s)")  # a wait worth naming
        choice = self._delta_filter()
        with still("starting the trainer"):
            self.trainer = TrainerGroup(self.placement, TrainerGroupConfig.from_run(self.config, self.initial_checkpoint))
            info = self.trainer.setup(self.run_id, delta_filter=choice.filter, place_timeout_s=place_timeout_s)
        self.run_id = info.get("run_id")
        status(f"trainer: {self.trainer.world_size} rank(s), {info['backend']}, ready in {info['setup_s']:.1f}s")
        if self._publishes() and not self.config.rollout.rollout_external:
            status(f"weights: delta filter {choice.filter} ({choice.reason})")

    def _start_critic(self) -> None:
        from miles_disagg.trainer.critic_group import CriticGroup

        status(f"starting the critic: {len(self.placement.layout.critic)} rank(s)")
        with still("starting the critic"):
            self.critic = CriticGroup(self.placement, CriticGroupConfig.from_run(self.config))
            info = self.critic.setup()
        status(f"critic: {self.critic.world_size} rank(s), {info['backend']}, ready in {info['setup_s']:.1f}s")

    def restart_trainer(self, place_timeout_s: float | None = None) -> None:
        """Replace the trainer group after a rank died (``loop/trainer_restart.py``): the old
        ranks are killed, new ones start in the same bundles (after a node loss, where Ray placed
        them again; ``FailRun`` when that takes over ``place_timeout_s``), continue the run's
        version stream and learn the engines as the first ones did."""
        self._stop_trainer()
        self.trainer = None
        self._start_trainer(place_timeout_s)
        if self.engines is not None:
            self.trainer.set_rollout_engines(self.engines.engine_urls)
            if self._publishes() and self.config.rollout.rollout_external:
                self.trainer.set_delta_filter(self._delta_filter(attached=self.engines.delta_filters).filter)

    def _publishes(self) -> bool:
        return self.trainer is not None and self.config.weights.update_weight_transfer_mode == "disk-delta"

    def _start_engines(self) -> None:
        import dataclasses

        from miles_disagg.fleet.handle import EngineManagerHandle
        from miles_disagg.net.netbind import job_spans_nodes

        if self.config.rollout.rollout_service_url:
            self._connect_service()
            return
        from miles_disagg.fleet.plan import resolve_backend, unused_sglang_args

        spans_nodes = job_spans_nodes(self.placement.node_ids or ())
        manager_config = dataclasses.replace(EngineManagerConfig.from_run(self.config), spans_nodes=spans_nodes)
        note = unused_sglang_args(manager_config, None if self.config.rollout.rollout_external else
                                  resolve_backend(self.config.rollout.rollout_backend)[0])
        if note:
            status(note)
        attached = self.config.rollout.rollout_external
        status(f"attaching {len(self.config.rollout.rollout_external_engine_addrs)} engine(s)" if attached else
               f"starting {len(self.placement.layout.engines)} engine(s) and the router")
        self.engines = EngineManagerHandle(manager_config, self.placement)
        probe = self._write_store_probe()
        try:
            with still("attaching the engines" if attached else "starting the engines and the router"):
                self.engines.start(store_probe=probe)
        finally:
            if probe is not None:
                self.trainer.remove_store_probe(probe)
        self.router_url = self.engines.router_url
        status(f"engines: {len(self.engines.engine_urls)} behind the router at {self.router_url}")
        if manager_config.lora_base_dir and self.trainer is not None:  # the trainer wrote the chain's version 0
            self.engines.update_weights(0)  # the adapter as initialised, resident: nothing runs on the bare base
            status("engines: serving LoRA adapter version 0 (the adapter as initialised) beside the base")
        if self.trainer is not None:
            self.trainer.set_rollout_engines(self.engines.engine_urls)
        if self._publishes() and self.config.rollout.rollout_external:
            choice = self._delta_filter(attached=self.engines.delta_filters)  # what the attached engines announce
            self.trainer.set_delta_filter(choice.filter)
            status(f"weights: delta filter {choice.filter} ({choice.reason})")
        self._start_rollout()

    def _write_store_probe(self):
        """Disk-delta with managed engines: the trainer's probe each engine's node must read back."""
        cfg = self.config
        if self.trainer is None or cfg.rollout.rollout_external or cfg.weights.update_weight_transfer_mode != "disk-delta":
            return None
        return self.trainer.write_store_probe()

    def _connect_service(self) -> None:
        """Service topology: no engine handle at all; one endpoint, versions from the store."""
        import httpx

        url = self.config.rollout.rollout_service_url.rstrip("/")
        try:
            httpx.get(f"{url}/health", timeout=10, trust_env=False).raise_for_status()  # open: no key needed
        except httpx.HTTPError as exc:
            raise ConfigError(f"--rollout-service-url {url}: not answering /health ({exc})",
                              ("--rollout-service-url",)) from None
        from miles_disagg.service.client import check_service_serves, wake_replicas

        chain = EngineManagerConfig.from_run(self.config).lora_base_dir
        check_service_serves(url, chain)  # its replicas serve this run's adapter chain, or full weights
        if chain:  # the trainer has just written the chain's version 0: the replicas take it now
            wake_replicas(url)
        self.router_url = url
        status(f"rollout service at {url}; versions go through {self.config.weights.update_weight_disk_dir}"
               + (f" (LoRA adapter versions of the chain at {chain})" if chain else ""))
        self._start_rollout()

    def _start_rollout(self) -> None:
        from miles_disagg.fleet.plan import managed_backend
        from miles_disagg.rollout.handle import RolloutManagerHandle
        from miles_disagg.rollout.teacher import job_teacher

        run_id = self.run_id if self.config.rollout.rollout_service_url else None  # a service names runs
        backend = managed_backend(self.config.rollout)  # decides whether calls ask for MoE routing
        self.opd_teacher, teacher_url = job_teacher(self.config)
        self.rollout = RolloutManagerHandle(RolloutManagerConfig.from_run(self.config, self.router_url, run_id,
                                                                          backend=backend, job_teacher_url=teacher_url),
                                            data_position=self.data_position,
                                            scheduling_strategy=self.placement.control_strategy())

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

        from miles_disagg.remote import remove_watch

        remove_watch(self.node_watch)  # tearing down must not be cut short by the watches
        remove_watch(self._capacity_watch)
        for step in (self._stop_rollout, self._stop_teacher, self._stop_engines, self._stop_trainer, self._stop_critic):
            try:
                step()
            except Exception as exc:  # keep tearing down the rest
                status(f"shutdown: {type(exc).__name__}: {exc}")
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()

    def _stop_rollout(self) -> None:
        if self.rollout is not None:
            self.rollout.stop(timeout_s=30)

    def _stop_teacher(self) -> None:
        if self.opd_teacher is not None:
            self.opd_teacher.stop()

    def _stop_engines(self) -> None:
        if self.engines is not None:
            try:
                write_engine_events(self.config.tracking.run_dir, self.engines.events())
            finally:
                self.engines.shutdown(timeout_s=60)

    def _stop_trainer(self) -> None:
        if self.trainer is not None:
            self.trainer.shutdown()

    def _stop_critic(self) -> None:
        if self.critic is not None:
            self.critic.shutdown()


def _nodes_line(placement: Placement) -> str:
    return "; ".join(f"{site['node_ip']} ({node_id[:8]}): {', '.join(site['work'])}"
                     for node_id, site in work_by_node(placement).items())
