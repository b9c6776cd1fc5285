"""The replica agent: one engine, reconciled against the version store, reported to the gateway.

Lifecycle (:meth:`Replica.run`, until SIGTERM/SIGINT or ``POST /drain``):

1. Serve the control API (``GET /health``, ``GET /status``, ``POST /wake``, ``POST /drain``;
   ``/wake`` and ``/drain`` need the admin key, ``/status`` the API key when one is set).
2. Start or attach to the engine; register with the gateway as ``catching_up``.
3. Loop: wait for a wake (``POST /wake``) or ``poll_interval_s``, check the engine is
   alive (a managed engine that died is restarted from the base and catches up again),
   run one reconcile pass (:mod:`.reconciler`). A wake that arrives during a pass runs
   another pass right after it; it is never lost.
4. Heartbeat every ``heartbeat_interval_s`` (and at once on every state change).
5. Shutdown: report ``draining`` (no new requests), wait until the gateway has nothing in
   flight on the engine (at most ``drain_timeout_s``), deregister, stop the engine.

Heartbeats are sent one at a time, in the order their statuses were taken, so the
gateway never sees an older state after a newer one.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import logging
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from miles_disagg.net.asgi_guard import ServerGuard, install_guard, server_app
from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.launch import EngineSpec, RunningEngine, start_engine
from miles_disagg.service.adapters import GatewayLink, StoreView
from miles_disagg.service.protocol import ReplicaStatus
from miles_disagg.service.reconciler import PhaseHook, ReconcileConfig, Reconciler
from miles_disagg.types import ConfigError, MilesDisaggError, VersionRef

log = logging.getLogger(__name__)

PHASE_HOOK_FLAG = "--phase-hook"
DRAIN_POLL_S = 0.1
CONTROL_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    """Settings of one replica agent."""

    store_dir: str  # a directory or an object store URL
    """The version store (``--update-weight-disk-dir`` of the trainer)."""
    gateway_url: str
    """Where to register and heartbeat."""
    engine: EngineSpec
    """The engine to run (and, attached or not, its host-local checkpoint dir)."""
    attach_url: str | None = None
    """An engine someone else runs (``--engine url:...``): nothing is started, and its weights
    are of unknown version until the replica's first activation."""
    replica_id: str | None = None
    """Stable name of this replica (a restarted replica keeps it); default: the control API's host:port."""
    host: str = "127.0.0.1"
    """Address of the control API (the gateway calls ``/wake`` there)."""
    port: int = 0
    """Port of the control API (0: any free one)."""
    poll_interval_s: float = 1.0
    """Seconds between reconcile passes when nobody wakes the replica."""
    heartbeat_interval_s: float = 1.0
    """Seconds between heartbeats (state changes are reported at once)."""
    drain_timeout_s: float = 30.0
    """Longest wait for in-flight requests at shutdown."""
    reconcile: ReconcileConfig = field(default_factory=ReconcileConfig)
    phase_hook: str | None = None
    """``module:function`` called as ``hook(phase, version)`` at each phase (``staging``, ``staged``,
    ``paused``, ``activated``, ``failed``); raising fails a staging or activation phase."""
    guard: ServerGuard | None = None
    """Keys and request limit of the control API (None: keys from the environment); the replica
    sends the same keys to the gateway and to its engine."""
    lora_base_dir: Path | None = None
    """The engine serves the LoRA adapter versions of the chain whose version 0 is here (a built-in
    engine started with ``--enable-lora --lora-base-dir``): it takes no traffic before it activated one
    (the bare base is never served), and activation needs no pause."""

    def __post_init__(self) -> None:
        for name in ("poll_interval_s", "heartbeat_interval_s", "drain_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")


def load_phase_hook(spec: str | None) -> PhaseHook | None:
    """Resolve ``module:function`` and check it accepts ``(phase, version)``; ``ConfigError`` otherwise."""
    if not spec:
        return None
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{PHASE_HOOK_FLAG}: {spec!r} is not of the form module:function", flags=(PHASE_HOOK_FLAG,))
    try:
        fn = getattr(importlib.import_module(module_name), attr)
        inspect.signature(fn).bind("phase", 0)
    except (ImportError, AttributeError, TypeError) as exc:
        raise ConfigError(f"{PHASE_HOOK_FLAG}: cannot use {spec!r} as hook(phase, version): {exc}",
                          flags=(PHASE_HOOK_FLAG,)) from None
    return fn


class Replica:
    """One replica agent process; see the module docstring."""

    def __init__(self, config: ReplicaConfig):
        self.config = config
        self.incarnation = uuid.uuid4().hex[:12]
        self.guard = config.guard if config.guard is not None else ServerGuard.from_env()
        self.gateway = GatewayLink(config.gateway_url, keys=self.guard.keys)
        self.engine: RunningEngine | None = None
        self._engine_http: EngineClient | None = None
        self._num_engine_starts = 0
        reconcile = config.reconcile if config.lora_base_dir is None else \
            dataclasses.replace(config.reconcile, adapter_versions=True)
        self.reconciler = Reconciler(StoreView(config.store_dir), _NoEngine(), config=reconcile,
                                     notify=self.report, phase_hook=load_phase_hook(config.phase_hook))
        self._seq = itertools.count(1)
        self._report_lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._load: int | None = None
        self._last_report_error: str | None = None
        self._sock = listen_socket(config.host, config.port)
        self.control_url = f"http://{config.host}:{self._sock.getsockname()[1]}"
        self.replica_id = config.replica_id or self.control_url.removeprefix("http://")

    # ------------------------------------------------------------------ status and heartbeats

    def status(self, seq: int = 0) -> ReplicaStatus:
        record = self.reconciler.snapshot()
        live = record.live
        return ReplicaStatus(
            replica_id=self.replica_id, incarnation=self.incarnation, seq=seq,
            engine_url=self.engine.url if self.engine else None, control_url=self.control_url, state=record.state,
            weight_version=live.version if live else None, run_id=live.run_id if live else "",
            staged_version=record.staged_version, store_head=record.store_head, last_error=record.last_error,
            load=self._load, activations=record.activations, counters=record.counters,
            lora_base_dir=str(self.config.lora_base_dir) if self.config.lora_base_dir is not None else None)

    def report(self) -> None:
        """Send the current status now (best effort: a failure is logged once, the next beat retries)."""
        with self._report_lock:
            status = self.status(next(self._seq))
            try:
                self.gateway.report(status)
                self._last_report_error = None
            except MilesDisaggError as exc:
                if str(exc) != self._last_report_error:
                    log.warning("heartbeat failed: %s", exc)
                self._last_report_error = str(exc)

    def wake(self) -> None:
        self.reconciler.retry_now()
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # ------------------------------------------------------------------ main loop

    def run(self) -> None:
        """Run until stopped (see the module docstring); installs SIGTERM/SIGINT handlers
        when called on the main thread."""
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self.stop())
        server = _serve_control(self, self._sock)
        beat = threading.Thread(target=self._heartbeat_forever, name="heartbeat", daemon=True)
        try:
            self.report()  # known to the gateway while the engine starts
            beat.start()
            self._start_engine(restarted=False)
            while not self._stop.is_set():
                self._wake.wait(self.config.poll_interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    break
                if self._engine_ok():
                    self.reconciler.run_pass()
        finally:
            self._shutdown(server, beat)

    def _start_engine(self, *, restarted: bool) -> None:
        spec, attach_url = self.config.engine, self.config.attach_url
        if attach_url:
            self.engine, live = RunningEngine(attach_url, ()), None  # unknown until the first activation
        else:
            self._num_engine_starts += 1
            self.engine = start_engine(dataclasses.replace(spec, name=f"{spec.name}-{self._num_engine_starts}"))
            # a fresh managed engine serves the base; one serving adapter versions none until it activated one
            live = VersionRef("", 0) if self.config.lora_base_dir is None else None
        if self._engine_http is not None:
            self._engine_http.close()
        self._engine_http = EngineClient(self.engine.url, store_dir=self.config.store_dir,
                                         local_checkpoint_dir=spec.local_checkpoint_dir, timeout_s=CONTROL_TIMEOUT_S,
                                         keys=self.guard.keys)
        self.reconciler.engine = self._engine_http
        log.info("engine at %s (%s)", self.engine.url, "attached" if attach_url else spec.backend)
        self.reconciler.engine_started(live, restarted=restarted)

    def _engine_ok(self) -> bool:
        """True when the engine can be reconciled; restarts a managed engine that exited."""
        code = self.engine.exit_code() if self.engine else None
        if code is None:
            if self.engine is not None and not self.engine.processes and not self._engine_http.healthy():
                if self.reconciler.snapshot().live is not None:
                    self.reconciler.engine_lost(f"the attached engine {self.engine.url} does not answer /health")
                return False
            return True
        self.reconciler.engine_lost(f"the engine exited with code {code}; restarting it from the base")
        self.engine.stop()
        try:
            self._start_engine(restarted=True)
        except MilesDisaggError as exc:
            log.error("engine restart failed: %s", exc)
            self.reconciler.engine_lost(f"engine restart failed: {exc}")
            return False
        return True

    def _heartbeat_forever(self) -> None:
        while not self._stop.wait(self.config.heartbeat_interval_s):
            if self._engine_http is not None:
                self._load = self._engine_http.load_count()
            self.report()

    def _shutdown(self, server: Any, beat: threading.Thread) -> None:
        self._stop.set()
        self.reconciler.draining()
        if self.engine is not None:
            self._drain(self.engine.url)
        if beat.is_alive():
            beat.join()  # no heartbeat may re-register the replica after it deregistered
        try:
            self.gateway.deregister(self.replica_id)
        except MilesDisaggError as exc:
            log.warning("deregister failed: %s", exc)
        if self.engine is not None:
            self.engine.stop()
        server.should_exit = True
        self.gateway.close()

    def _drain(self, engine_url: str) -> None:
        deadline = time.monotonic() + self.config.drain_timeout_s
        while time.monotonic() < deadline:
            try:
                if self.gateway.outstanding(engine_url) == 0:
                    return
            except MilesDisaggError:
                return  # no gateway: nothing can be in flight through it
            time.sleep(DRAIN_POLL_S)
        log.warning("requests still in flight on %s after %.0fs; stopping anyway", engine_url,
                    self.config.drain_timeout_s)


class _NoEngine:
    """The engine port before the engine is up (passes do not run in state ``starting``)."""

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def refuse(*_args: Any) -> Any:
            raise MilesDisaggError("the engine is not started yet")
        return refuse


def listen_socket(host: str, port: int, backlog: int = 128) -> socket.socket:
    """Bind and listen now, so a taken port fails fast (``ConfigError``); port 0 picks a free one."""
    from miles_disagg.net.process import listen_socket as listen

    return listen(host, port, backlog)


def _serve_control(replica: Replica, sock: socket.socket):
    """The control API on ``sock`` in a daemon thread; returns the uvicorn server."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(control_app(replica), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="control-api", daemon=True).start()
    return server


def control_app(replica: Replica):
    app = server_app("miles-disagg replica")
    install_guard(app, replica.guard)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/status")
    async def status():
        return replica.status().to_json()

    @app.post("/wake")
    async def wake():
        replica.wake()
        return {"woken": True}

    @app.post("/drain")
    async def drain():
        replica.stop()
        return {"draining": True}

    return app
