"""Replicas as Ray actors on the rollout's own Ray cluster, sized by the gateway's load.

The rollout cluster is not the trainer's: the pool runs in its own driver process
(``miles-disagg serve ray --address ...``), since one process holds one Ray connection.
Each replica is a :class:`ReplicaActor` that owns one replica agent process (the same
``python -m miles_disagg.service replica`` a local pool runs) on the actor's node,
placed with ``num_gpus_per_replica`` GPUs (and, with ``replica_resource``, only on nodes
offering that custom resource). The gateway runs beside the driver. On a cluster of more
than one node, replicas bind their node's IP (:func:`miles_disagg.net.netbind.bind_host`) and the
gateway must bind an address the other nodes reach (a loopback ``host`` is refused).

Scaling (:meth:`RayReplicaPool.autoscale_once`): read the gateway's ``load``, ask the
:class:`~miles_disagg.service.scaling.Autoscaler`, add or remove replicas. A new replica
catches up before it takes traffic; a removed one drains first (no new requests, in-flight
ones finish), so scaling never loses a request. :meth:`RayReplicaPool.heal` restarts
replica processes that died and drops actors that are gone (the next scaling step
replaces them).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from miles_disagg.service.client import GatewayClient
from miles_disagg.service.launch import ReplicaOptions, launch_gateway, replica_command, spawn_replica
from miles_disagg.service.scaling import Autoscaler, ScalingConfig
from miles_disagg.types import MilesDisaggError

log = logging.getLogger(__name__)

ACTOR_CALL_TIMEOUT_S = 120.0
REPLICA_RESOURCE_SHARE = 0.01
"""How much of ``replica_resource`` a replica asks for: only its presence on a node matters."""


@dataclass(frozen=True, kw_only=True)
class RayServiceConfig:
    """A gateway plus autoscaled replica actors."""

    store_dir: str  # a directory or an object store URL
    base_dir: Path | None  # None: every replica fetches the store's base (ReplicaOptions.base_from_store)
    work_dir: Path
    """Local checkpoints and logs, per replica (a path valid on every node)."""
    host: str = "127.0.0.1"
    """Gateway bind address (use the driver's IP for a multi-node cluster)."""
    port: int = 0
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    replica: ReplicaOptions = field(default_factory=ReplicaOptions)
    replica_host: str | None = None
    """Address replicas and engines bind; None: decided at start (loopback on a one-node cluster,
    else the actor node's IP: :func:`miles_disagg.net.netbind.bind_host`)."""
    replica_resource: str | None = None
    """Place replicas only on nodes offering this Ray custom resource (None: anywhere)."""
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    scale_interval_s: float = 2.0
    heartbeat_timeout_s: float = 3.0


class ReplicaActor:
    """Ray actor body: one replica agent process on this node (see the module docstring)."""

    def __init__(self, replica_id: str, config: RayServiceConfig, gateway_url: str):
        self.replica_id, self.config, self.gateway_url = replica_id, config, gateway_url
        self.process = None

    def start(self) -> str:
        """Start the replica process; returns its control URL once it answers."""
        from miles_disagg.net.netbind import NODE_IP, resolve_host
        from miles_disagg.net.process import free_port

        host = resolve_host(self.config.replica_host or NODE_IP)
        port = free_port(host)
        work = self.config.work_dir / self.replica_id
        cmd = replica_command(replica_id=self.replica_id, store_dir=self.config.store_dir,
                              base_dir=self.config.base_dir, gateway_url=self.gateway_url, work_dir=work, host=host,
                              port=port, options=self.config.replica)
        self.process = spawn_replica(cmd, replica_id=self.replica_id, control_url=f"http://{host}:{port}",
                                     log_path=work / "logs" / "replica.log", env=self.config.replica.env)
        return self.process.control_url

    def ensure_running(self) -> bool:
        """Start the replica again if its process died; True when it had to."""
        if self.process is not None and self.process.alive():
            return False
        if self.process is not None:
            self.process.kill()
        self.start()
        return True

    def stop(self, timeout_s: float = 60.0) -> None:
        """Drain and stop the replica (and its engine)."""
        if self.process is not None:
            self.process.stop(timeout_s)


class RayReplicaPool:
    """The replica actors of one service; called from one controller thread."""

    def __init__(self, config: RayServiceConfig, gateway_url: str):
        import ray

        self.config, self.gateway_url = config, gateway_url
        self.autoscaler = Autoscaler(config.scaling)
        from miles_disagg.net.auth import ApiKeys

        keys_env = ApiKeys.from_env().env()  # the replicas enforce and send the service's keys
        resources = {config.replica_resource: REPLICA_RESOURCE_SHARE} if config.replica_resource else None
        self._actor_class = ray.remote(num_cpus=config.num_cpus_per_replica, num_gpus=config.num_gpus_per_replica,
                                       resources=resources,
                                       runtime_env={"env_vars": keys_env} if keys_env else None)(ReplicaActor)
        self._actors: dict[str, object] = {}
        self._next_id = 0

    def size(self) -> int:
        return len(self._actors)

    def replica_ids(self) -> list[str]:
        return list(self._actors)

    def scale_to(self, target: int) -> None:
        """Add replicas (started in parallel) or remove the newest ones (each drains first)."""
        import ray

        while len(self._actors) > target:
            replica_id = list(self._actors)[-1]
            actor = self._actors.pop(replica_id)
            log.info("removing replica %s", replica_id)
            try:
                ray.get(actor.stop.remote(), timeout=ACTOR_CALL_TIMEOUT_S)
            finally:
                ray.kill(actor)
        added = {}
        while len(self._actors) + len(added) < target:
            replica_id = f"ray-{self._next_id}"
            self._next_id += 1
            added[replica_id] = self._actor_class.remote(replica_id, self.config, self.gateway_url)
        if added:
            log.info("adding replicas %s", list(added))
            ray.get([a.start.remote() for a in added.values()], timeout=ACTOR_CALL_TIMEOUT_S)
            self._actors.update(added)

    def autoscale_once(self, client: GatewayClient, now: float | None = None) -> int:
        """One scaling decision from the gateway's load; returns the replica count now."""
        load = client.metrics()["load"]
        target = self.autoscaler.decide(load["in_flight"], load["num_unserved"], self.size(),
                                        time.monotonic() if now is None else now)
        if target != self.size():
            log.info("scaling %d -> %d replicas (in flight %d)", self.size(), target, load["in_flight"])
            self.scale_to(target)
        return self.size()

    def heal(self) -> None:
        """Restart dead replica processes; forget actors that are gone."""
        import ray
        from ray.exceptions import RayActorError

        for replica_id, actor in list(self._actors.items()):
            try:
                if ray.get(actor.ensure_running.remote(), timeout=ACTOR_CALL_TIMEOUT_S):
                    log.warning("replica %s had died; started again", replica_id)
            except RayActorError:
                log.warning("replica actor %s is gone", replica_id)
                del self._actors[replica_id]

    def stop(self) -> None:
        self.scale_to(0)


def _bind_replicas(config: RayServiceConfig) -> RayServiceConfig:
    """Replicas bind loopback on a one-node cluster, the node IP otherwise, and then never without
    an admin key: one is generated (into this process's environment, which the gateway and every
    replica inherit) when none was given."""
    import dataclasses

    from miles_disagg.net.auth import ApiKeys
    from miles_disagg.net.netbind import bind_host, export_keys, job_spans_nodes, run_keys

    if config.replica_host is not None:
        return config
    spans = job_spans_nodes([])
    if spans and ApiKeys.from_env().admin_api_key is None:
        log.warning("the rollout cluster spans nodes and no admin key was given: generating one for this service")
        export_keys(run_keys(None, None))
    return dataclasses.replace(config, replica_host=bind_host(spans_nodes=spans))


def run_ray_service(config: RayServiceConfig, *, address: str | None, stop: threading.Event,
                    on_ready: Callable[[str], None] = lambda url: None) -> None:
    """Connect to the rollout Ray cluster, start the gateway and ``min_replicas``, then heal and
    autoscale every ``scale_interval_s`` until ``stop`` is set (SIGTERM/SIGINT set it when called on
    the main thread); everything is stopped on return. Without ``address`` a local Ray is started
    with token authentication on and no dashboard. Replica actors get this process's keys
    (:data:`~miles_disagg.net.auth.ADMIN_API_KEY_ENV`, ...) through their runtime environment."""
    import ray

    if address is None:  # a cluster of our own: no dashboard (its jobs API runs code unauthenticated)
        from miles_disagg.net.netbind import LOCAL_RAY_SYSTEM_CONFIG, keep_ray_token_auth

        keep_ray_token_auth()
        ray.init(include_dashboard=False, ignore_reinit_error=True, logging_level="WARNING",
                 _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    else:
        ray.init(address=address, ignore_reinit_error=True, logging_level="WARNING")
    _check_cluster(config)
    if threading.current_thread() is threading.main_thread():  # after ray.init, which sets its own SIGTERM handler
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    config = _bind_replicas(config)
    config.work_dir.mkdir(parents=True, exist_ok=True)
    gateway = launch_gateway(log_path=config.work_dir / "gateway.log", port=config.port, host=config.host,
                             heartbeat_timeout_s=config.heartbeat_timeout_s, lora_base_dir=config.replica.lora_base_dir)
    pool = RayReplicaPool(config, gateway.url)
    try:
        pool.scale_to(config.scaling.min_replicas)
        on_ready(gateway.url)
        with GatewayClient(gateway.url) as client:
            while not stop.wait(config.scale_interval_s):
                try:
                    pool.heal()
                    pool.autoscale_once(client)
                except MilesDisaggError as exc:  # e.g. the gateway restarting: decide again next round
                    log.warning("scaling round skipped: %s", exc)
    finally:
        pool.stop()
        gateway.stop()


def _check_cluster(config: RayServiceConfig) -> None:
    """``ConfigError`` when replicas on other nodes of the connected cluster could not reach the
    gateway, or no node offers ``replica_resource``."""
    import ray

    from miles_disagg.net.netbind import LOOPBACK
    from miles_disagg.types import ConfigError

    nodes = [node for node in ray.nodes() if node["Alive"]]
    spans = len(nodes) > 1
    if spans and config.host in (LOOPBACK, "localhost", "::1"):
        raise ConfigError(f"--host {config.host}: this Ray cluster has {len(nodes)} nodes and replicas on the others "
                          f"cannot reach a gateway on loopback; give this node's address (--host "
                          f"{ray.util.get_node_ip_address()}) or 0.0.0.0", ("--host",))
    if config.replica_resource and not any(config.replica_resource in node["Resources"] for node in nodes):
        raise ConfigError(f"--replica-resource {config.replica_resource!r}: no node of this Ray cluster offers it",
                          ("--replica-resource",))
