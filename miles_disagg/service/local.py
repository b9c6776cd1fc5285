"""A local rollout service: a gateway on ``host:port`` and N replica processes on this machine.

``launch_local_service(store_dir, base_dir, work_dir=..., num_replicas=N)`` returns a
:class:`LocalService` with ``url`` (the one endpoint) and ``stop()``. Replicas reconcile
against ``store_dir`` by themselves: a version published there (``miles-disagg weights
publish``, or a trainer's ``DeltaPublisher``) reaches every replica with no further call
(``wake()`` only shortens the wait to well under one poll interval).

Supervision: a replica process that exits without being asked to (crash, kill) is
started again with the same id and local checkpoint directory; it registers as
``catching_up`` and takes traffic only after it activated the store's newest version.
Replicas can be added and removed while the service serves; removal drains first.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path

from miles_disagg.net.process import LaunchedProcess, free_port
from miles_disagg.service.client import GatewayClient
from miles_disagg.service.launch import (ReplicaOptions, ReplicaProcess, launch_gateway, replica_command,
                                         spawn_replica)
from miles_disagg.types import InvalidInput
from miles_disagg.weights.location import normalize_store

log = logging.getLogger(__name__)

SUPERVISE_INTERVAL_S = 0.2


@dataclass(frozen=True, kw_only=True)
class LocalServiceConfig:
    """A gateway and its replicas on this machine."""

    store_dir: str  # a directory or an object store URL
    """The version store replicas follow."""
    base_dir: Path | None  # None: every replica fetches the store's base (ReplicaOptions.base_from_store)
    """The base checkpoint (version 0)."""
    work_dir: Path
    """Local checkpoints (``replica-ID/local-checkpoint``) and logs go here."""
    num_replicas: int = 2
    """Replicas started at launch."""
    host: str = "127.0.0.1"
    port: int = 0
    """Gateway port (0: a free one)."""
    health_check_interval_s: float = 0.5
    heartbeat_timeout_s: float = 3.0
    retry_after_s: float = 1.0
    replica: ReplicaOptions = field(default_factory=ReplicaOptions)
    restart_replicas: bool = True
    """Start a replica again when its process exits unasked."""

    def __post_init__(self) -> None:
        if self.num_replicas < 0:
            raise ValueError(f"num_replicas must be >= 0, got {self.num_replicas}")


class LocalService:
    """Handle on a running local service; see the module docstring. Thread-safe."""

    def __init__(self, config: LocalServiceConfig):
        self.config = config
        self.gateway: LaunchedProcess | None = None
        self._replicas: dict[str, ReplicaProcess] = {}
        self._restarts: dict[str, int] = {}
        self._options: dict[str, ReplicaOptions] = {}
        self._next_id = 0
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="replica-supervisor", daemon=True)

    @property
    def url(self) -> str:
        return self.gateway.url

    def start(self) -> "LocalService":
        cfg = self.config
        cfg.work_dir.mkdir(parents=True, exist_ok=True)
        self.gateway = launch_gateway(log_path=cfg.work_dir / "gateway.log", port=cfg.port, host=cfg.host,
                                      health_check_interval_s=cfg.health_check_interval_s,
                                      heartbeat_timeout_s=cfg.heartbeat_timeout_s, retry_after_s=cfg.retry_after_s,
                                      lora_base_dir=cfg.replica.lora_base_dir)
        try:
            for _ in range(cfg.num_replicas):
                self.add_replica()
        except BaseException:
            self.stop()
            raise
        self._supervisor.start()
        return self

    def client(self, timeout_s: float = 30.0) -> GatewayClient:
        """A new :class:`GatewayClient` for the gateway (close it when done)."""
        return GatewayClient(self.url, timeout_s=timeout_s)

    def replica_ids(self) -> list[str]:
        with self._lock:
            return list(self._replicas)

    def replica(self, replica_id: str) -> ReplicaProcess:
        with self._lock:
            if replica_id not in self._replicas:
                raise InvalidInput(f"no replica {replica_id!r} in this service (have {list(self._replicas)})")
            return self._replicas[replica_id]

    def restarts(self, replica_id: str) -> int:
        with self._lock:
            return self._restarts.get(replica_id, 0)

    # ------------------------------------------------------------------ membership

    def add_replica(self, options: ReplicaOptions | None = None) -> str:
        """Start one more replica (it catches up before it takes traffic); returns its id."""
        with self._lock:
            replica_id = f"local-{self._next_id}"
            self._next_id += 1
            self._options[replica_id] = options or self.config.replica
            self._replicas[replica_id] = self._spawn(replica_id, self._options[replica_id])
            return replica_id

    def remove_replica(self, replica_id: str, timeout_s: float = 60.0) -> None:
        """Drain (no new requests, in-flight ones finish), deregister and stop one replica."""
        with self._lock:
            replica = self.replica(replica_id)
            del self._replicas[replica_id]
        replica.stop(timeout_s)

    def kill_replica(self, replica_id: str) -> None:
        """SIGKILL a replica and its engine (a crash); the supervisor starts it again."""
        self.replica(replica_id).kill()

    def _spawn(self, replica_id: str, options: ReplicaOptions) -> ReplicaProcess:
        cfg = self.config
        port = free_port(cfg.host)
        work = cfg.work_dir / replica_id
        cmd = replica_command(replica_id=replica_id, store_dir=cfg.store_dir, base_dir=cfg.base_dir,
                              gateway_url=self.url, work_dir=work, host=cfg.host, port=port, options=options)
        return spawn_replica(cmd, replica_id=replica_id, control_url=f"http://{cfg.host}:{port}",
                             log_path=work / "logs" / "replica.log", env=options.env)

    def _supervise(self) -> None:
        while not self._stopping.wait(SUPERVISE_INTERVAL_S):
            if not self.config.restart_replicas:
                continue
            with self._lock:
                dead = [(rid, r) for rid, r in self._replicas.items() if not r.alive()]
                for replica_id, replica in dead:
                    if self._stopping.is_set():
                        return
                    log.warning("replica %s exited with %s; starting it again", replica_id, replica.proc.returncode)
                    replica.kill()  # whatever is left of its group (its engine)
                    try:
                        self._replicas[replica_id] = self._spawn(replica_id, self._options[replica_id])
                        self._restarts[replica_id] = self._restarts.get(replica_id, 0) + 1
                    except Exception:  # noqa: BLE001 - try again at the next round
                        log.exception("restarting replica %s failed", replica_id)

    # ------------------------------------------------------------------ shutdown

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every replica (draining) and then the gateway; idempotent."""
        self._stopping.set()
        if self._supervisor.is_alive():
            self._supervisor.join()
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        for replica in replicas:
            if replica.alive():
                replica.proc.terminate()
        for replica in replicas:
            replica.stop(timeout_s)
        if self.gateway is not None:
            self.gateway.stop()

    def __enter__(self) -> "LocalService":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_local_service(store_dir: str | Path, base_dir: str | Path | None, *, work_dir: str | Path, num_replicas: int = 2,
                         port: int = 0, host: str = "127.0.0.1", wait_ready_s: float | None = 300.0,
                         replica: ReplicaOptions | None = None, **config) -> LocalService:
    """Start a gateway and ``num_replicas`` replicas; with ``wait_ready_s``, return once every
    replica is ready at the store's newest version (``TimeoutError``/``VersionNotReady`` otherwise,
    after stopping everything). ``config``: other :class:`LocalServiceConfig` fields. Replicas serving
    LoRA adapter versions whose chain the run has not written yet (:func:`awaits_adapter_chain`) are
    not waited for: they catch up once it appears."""
    cfg = LocalServiceConfig(store_dir=normalize_store(store_dir), base_dir=None if base_dir is None else Path(base_dir),
                             work_dir=Path(work_dir),
                             num_replicas=num_replicas, port=port, host=host, replica=replica or ReplicaOptions(),
                             **config)
    service = LocalService(cfg).start()
    if wait_ready_s is not None and num_replicas > 0 and not awaits_adapter_chain(cfg.replica):
        try:
            with service.client() as client:
                client.wait_converged(_store_head(cfg.store_dir), num_replicas=num_replicas, timeout_s=wait_ready_s)
        except BaseException:
            service.stop()
            raise
    return service


def awaits_adapter_chain(options: ReplicaOptions) -> bool:
    """Whether the replicas serve LoRA adapter versions of a chain whose version 0 is not written yet
    (a run writes it as it starts; until then they stay ``catching_up``, serving nothing)."""
    from miles_disagg.weights.adapters import is_adapter_dir

    return options.lora_base_dir is not None and not is_adapter_dir(options.lora_base_dir)


def _store_head(store_dir: str) -> int:
    from miles_disagg.weights.stores import open_store

    latest = open_store(store_dir).latest()
    return latest.version if latest else 0
