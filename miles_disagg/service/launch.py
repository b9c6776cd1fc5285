"""Start service processes: the gateway, and replica agents (each in its own process group).

A replica runs in a new session so that it and its engine form one process group:
:meth:`ReplicaProcess.kill` takes both down at once (a crash), :meth:`ReplicaProcess.stop`
asks the replica to drain and leave (SIGTERM), then kills whatever is left. Every child
gets SIGTERM when the thread that started it dies (``die_with_parent``), so an owner that
crashes (a driver, a Ray actor) leaves no replica, engine or gateway behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from miles_disagg.net.process import LaunchedProcess, NotHealthy, die_with_parent, free_port, start_http_process, wait_healthy
from miles_disagg.types import ReplaceReplica

GATEWAY_STARTUP_TIMEOUT_S = 60.0
REPLICA_STARTUP_TIMEOUT_S = 60.0


class ServiceStartFailed(ReplaceReplica):
    """A gateway or replica process exited or never answered; it has been stopped."""


def launch_gateway(*, log_path: Path, port: int = 0, host: str = "127.0.0.1", health_check_interval_s: float = 0.5,
                   heartbeat_timeout_s: float = 3.0, retry_after_s: float = 1.0,
                   startup_timeout_s: float = GATEWAY_STARTUP_TIMEOUT_S,
                   lora_base_dir: Path | None = None) -> LaunchedProcess:
    """``python -m miles_disagg.service gateway`` on ``host:port`` (0: a free port), once it answers ``/health``.
    ``lora_base_dir``: its replicas serve the LoRA adapter versions of that chain (``--lora-base-dir``)."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "miles_disagg.service", "gateway", "--host", host, "--port", str(port),
           "--health-check-interval", str(health_check_interval_s), "--heartbeat-timeout", str(heartbeat_timeout_s),
           "--retry-after-s", str(retry_after_s)]
    cmd += ["--lora-base-dir", str(lora_base_dir)] if lora_base_dir is not None else []
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/health",
                              what="gateway", error=ServiceStartFailed, startup_timeout_s=startup_timeout_s, poll_s=0.05)


@dataclass(frozen=True, kw_only=True)
class ReplicaOptions:
    """Options every replica of a pool gets (see ``miles-disagg serve replica --help``)."""

    engine: str = "builtin"
    poll_interval_s: float = 0.5
    heartbeat_interval_s: float = 0.5
    pause_mode: str = "retract"
    max_restages: int = 2
    pre_read_hook: str | None = None
    phase_hook: str | None = None
    engine_args: tuple[str, ...] = ()
    drain_timeout_s: float = 30.0
    base_from_store: bool = False
    """Each replica fetches the store's base onto its node (then ``base_dir`` is ``None``)."""
    lora_base_dir: Path | None = None
    """Serve a run's LoRA adapter versions: the adapter chain's version 0 (built-in engines with
    ``--enable-lora --lora-base-dir``; the gateway takes only replicas of this chain)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for the replica (and its engine), e.g. ``PYTHONPATH`` for hooks."""


def replica_command(*, replica_id: str, store_dir: str | Path, base_dir: Path | None, gateway_url: str, work_dir: Path,
                    host: str, port: int, options: ReplicaOptions) -> list[str]:
    """The ``python -m miles_disagg.service replica`` argv; state and logs go under ``work_dir``."""
    cmd = [sys.executable, "-m", "miles_disagg.service", "replica", "--replica-id", replica_id,
           "--store", str(store_dir), "--gateway", gateway_url,
           "--engine", options.engine, "--local-checkpoint-dir", str(work_dir / "local-checkpoint"),
           "--log-dir", str(work_dir / "logs"), "--host", host, "--port", str(port),
           "--poll-interval", str(options.poll_interval_s), "--heartbeat-interval", str(options.heartbeat_interval_s),
           "--pause-mode", options.pause_mode, "--max-restages", str(options.max_restages),
           "--drain-timeout", str(options.drain_timeout_s)]
    cmd += ["--base-from-store"] if options.base_from_store else ["--base-dir", str(base_dir)]
    for flag, value in (("--pre-read-hook", options.pre_read_hook), ("--phase-hook", options.phase_hook),
                        ("--lora-base-dir", options.lora_base_dir)):
        if value:
            cmd += [flag, value]
    for arg in options.engine_args:
        cmd.append(f"--engine-arg={arg}")
    return cmd


@dataclass
class ReplicaProcess:
    """A replica agent process (leader of its own process group, with its engine)."""

    replica_id: str
    proc: subprocess.Popen
    control_url: str
    log_path: Path

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the replica and its engine at once (as a crash would)."""
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the replica to drain and leave (SIGTERM), wait, then kill whatever is left of its group."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def spawn_replica(cmd: list[str], *, replica_id: str, control_url: str, log_path: Path,
                  env: Mapping[str, str] = (), startup_timeout_s: float = REPLICA_STARTUP_TIMEOUT_S) -> ReplicaProcess:
    """Start a replica in a new session; return once its control API answers ``/health``
    (its engine may still be starting: the gateway lists it ``starting``/``catching_up``)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **dict(env)}, preexec_fn=die_with_parent)
    replica = ReplicaProcess(replica_id, proc, control_url, log_path)
    try:
        wait_healthy(control_url, timeout_s=startup_timeout_s, poll_s=0.05, proc=proc)
    except NotHealthy as exc:
        replica.kill()
        raise ServiceStartFailed(f"replica {replica_id} {exc.reason}:\n{replica.logs()[-4000:]}") from None
    return replica


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
