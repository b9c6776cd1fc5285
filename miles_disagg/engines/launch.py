"""Start engine processes: the one launcher for every topology (managed rollout, service replicas).

:func:`start_engine` takes an :class:`EngineSpec` and returns a :class:`RunningEngine` whose
``url`` speaks the engine API plus ``/pull_weights``:

* ``builtin``: the built-in engine (``python -m miles_disagg.engines.builtin``); it
  implements ``/pull_weights`` itself.
* ``sglang``: ``python -m sglang.launch_server`` (``--weight-version 0``) fronted by
  ``miles-disagg agent`` on the same host, which adds ``/pull_weights``; the URL is the agent's.

Every child is started by :func:`miles_disagg.net.process.start_http_process` (one health-poll
loop), dies with its owner (PDEATHSIG), and a start that fails stops what it started and
raises ``EngineUnrecoverable`` with the log tail.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from miles_disagg.net.process import LaunchedProcess, free_port, start_http_process
from miles_disagg.types import EngineUnrecoverable

__all__ = ["EngineSpec", "LaunchedEngine", "PlannedProcess", "RunningEngine", "agent_command", "builtin_engine_command",
           "engine_processes", "free_port", "launch_agent", "launch_engine", "launch_sglang", "start_engine"]

BACKENDS = ("builtin", "sglang")
BUILTIN_STARTUP_TIMEOUT_S = 300.0
AGENT_STARTUP_TIMEOUT_S = 60.0
SGLANG_STARTUP_TIMEOUT_S = 900.0


class LaunchedEngine(LaunchedProcess):
    """A running engine (or agent) process: its URL, process handle and log file."""


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """How to start one engine (what a managed rollout and a service replica both need)."""

    backend: str
    """``builtin`` or ``sglang``."""
    model_path: Path
    """The base checkpoint (version 0) the engine starts from."""
    local_checkpoint_dir: Path
    """Host-local checkpoint ``/pull_weights`` materializes into (the agent's, for SGLang)."""
    store_dir: str | None = None
    """The version store ``/pull_weights`` may read: a directory or an object store URL (``--weight-store-dir``; None: pulls are refused)."""
    log_dir: Path
    """Where the engine (and agent) logs go."""
    name: str = "engine"
    """Names the log files (``<name>.log``; ``sglang-<name>.log`` and ``agent-<name>.log`` for SGLang)."""
    host: str = "127.0.0.1"
    """Address the engine (and agent) bind."""
    tp_size: int = 1
    """SGLang tensor-parallel size."""
    base_gpu_id: int = 0
    """SGLang's first GPU."""
    dtype: str = "auto"
    seed: int | None = None
    """Sampling seed of the engine (``--random-seed``, built-in engine and SGLang alike)."""
    max_running_requests: int | None = None
    """Built-in engine: most requests decoded together."""
    pre_read_hook: str | None = None
    """``module:function`` run before a pull reads the store (object-store mounts)."""
    region: str = ""
    """The engine's region label (``--region`` of the engine or its agent)."""
    base_from_store: bool = False
    """Fetch ``model_path`` (the base, version 0) from the object store ``store_dir`` before starting."""
    sglang_args: Mapping[str, object] = field(default_factory=dict)
    """``--sglang-*`` passthrough options keyed by SGLang flag name (see :mod:`miles_disagg.engines.sglang`)."""
    extra_args: tuple[str, ...] = ()
    """Raw extra arguments for the engine command line (built-in engine or SGLang)."""
    sglang_env: Mapping[str, str] | None = None
    """The SGLang server's whole environment (None: this process's)."""
    lora: Any = None
    """SGLang only: its LoRA server args (:class:`~miles_disagg.engines.sglang.LoraServing`; None: none)."""
    agent_args: tuple[str, ...] = ()
    """SGLang only: extra arguments of the agent in front of it (``--lora-base-dir`` of a LoRA run)."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")


@dataclass
class RunningEngine:
    """A started engine: the URL to talk to and its processes (engine first, then the agent)."""

    url: str
    processes: tuple[LaunchedProcess, ...]

    def exit_code(self) -> int | None:
        """The first process's exit code if one has exited, else None."""
        for handle in self.processes:
            code = handle.proc.poll()
            if code is not None:
                return code
        return None

    def alive(self) -> bool:
        return bool(self.processes) and self.exit_code() is None

    def pid(self) -> int | None:
        """The engine process's pid (what a fault drill kills)."""
        return self.processes[0].proc.pid if self.processes else None

    def stop(self) -> None:
        for handle in reversed(self.processes):
            handle.stop()


@dataclass(frozen=True)
class PlannedProcess:
    """One process a start would run: its role, argv and log file (``--dry-run`` prints these)."""

    role: str
    """``engine`` (built-in), ``sglang`` or ``agent``."""
    argv: list[str]
    log_path: Path


def engine_processes(spec: EngineSpec, *, port: int | str, agent_port: int | str | None = None,
                     engine_url: str | None = None) -> list[PlannedProcess]:
    """The processes :func:`start_engine` runs for ``spec``, in start order (the argv it uses)."""
    if spec.backend == "builtin":
        return [PlannedProcess("engine", builtin_engine_command(spec.model_path, spec.host, port, _builtin_args(spec)),
                               spec.log_dir / f"{spec.name}.log")]
    from miles_disagg.engines.sglang import sglang_command

    cmd = sglang_command(str(spec.model_path), host=spec.host, port=port, tp_size=spec.tp_size,
                         base_gpu_id=spec.base_gpu_id, dtype=spec.dtype, weight_version=0, random_seed=spec.seed,
                         extra_args={**spec.sglang_args, **_sglang_key_args(spec)}, lora=spec.lora) + list(spec.extra_args)
    agent = agent_command(engine_url or f"http://{spec.host}:{port}", spec.local_checkpoint_dir, host=spec.host,
                          port=agent_port if agent_port is not None else "{agent_port}", base_dir=spec.model_path,
                          pre_read_hook=spec.pre_read_hook, store_dirs=_store_dirs(spec), region=spec.region,
                          extra_args=spec.agent_args)
    return [PlannedProcess("sglang", cmd, spec.log_dir / f"sglang-{spec.name}.log"),
            PlannedProcess("agent", agent, spec.log_dir / f"agent-{spec.name}.log")]


def start_engine(spec: EngineSpec) -> RunningEngine:
    """Start the engine ``spec`` describes; see the module docstring."""
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    if spec.base_from_store:
        fetch_base(spec)
    if spec.backend == "builtin":
        engine = launch_engine(spec.model_path, log_path=spec.log_dir / f"{spec.name}.log", host=spec.host,
                               extra_args=_builtin_args(spec))
        return RunningEngine(engine.url, (engine,))
    return _start_sglang_with_agent(spec)


def fetch_base(spec: EngineSpec) -> Path:
    """The store's base into ``spec.model_path`` on this node (kept when it holds it already)."""
    from miles_disagg.weights.object_base import pull_base
    from miles_disagg.weights.object_store import ObjectVersionStore
    from miles_disagg.weights.stores import open_store

    store = open_store(spec.store_dir or "", cache_dir=Path(spec.model_path).parent / ".base-mirror")
    if not isinstance(store, ObjectVersionStore):
        raise EngineUnrecoverable(f"{spec.name}: the base comes from an object store, not {spec.store_dir!r}")
    return pull_base(store, Path(spec.model_path))


def _builtin_args(spec: EngineSpec) -> list[str]:
    args = ["--dtype", spec.dtype]
    if spec.seed is not None:
        args += ["--random-seed", str(spec.seed)]
    if spec.max_running_requests is not None:
        args += ["--max-running-requests", str(spec.max_running_requests)]
    if spec.pre_read_hook:
        args += ["--custom-pull-weights-pre-read-hook", spec.pre_read_hook]
    args += ["--local-checkpoint-dir", str(spec.local_checkpoint_dir)]  # the one place it may write
    if spec.store_dir is not None:
        args += ["--weight-store-dir", str(spec.store_dir)]
    if spec.region:
        args += ["--region", spec.region]
    return args + list(spec.extra_args)


def _start_sglang_with_agent(spec: EngineSpec) -> RunningEngine:
    port = free_port(spec.host)
    sglang, agent_plan = engine_processes(spec, port=port)
    engine = launch_sglang(sglang.argv, url=f"http://{spec.host}:{port}", log_path=sglang.log_path,
                           env=None if spec.sglang_env is None else dict(spec.sglang_env))
    try:
        agent = launch_agent(engine.url, spec.local_checkpoint_dir, log_path=agent_plan.log_path,
                             host=spec.host, base_dir=spec.model_path, pre_read_hook=spec.pre_read_hook,
                             store_dirs=_store_dirs(spec),
                             extra_args=(("--region", spec.region) if spec.region else ()) + spec.agent_args)
    except BaseException:
        engine.stop()
        raise
    return RunningEngine(agent.url, (engine, agent))


def builtin_engine_command(model_dir: Path, host: str, port: int | str, extra_args: Sequence[str] = ()) -> list[str]:
    """``python -m miles_disagg.engines.builtin`` serving ``model_dir`` on ``host:port``."""
    return [sys.executable, "-m", "miles_disagg.engines.builtin", "--model-path", str(model_dir),
            "--host", host, "--port", str(port), *extra_args]


def agent_command(engine_url: str, local_checkpoint_dir: Path, *, host: str, port: int | str,
                  base_dir: Path | None = None, pre_read_hook: str | None = None,
                  store_dirs: Sequence[str] = (), extra_args: Sequence[str] = (), region: str = "") -> list[str]:
    """``python -m miles_disagg.engines.agent`` in front of ``engine_url`` on ``host:port``."""
    cmd = [sys.executable, "-m", "miles_disagg.engines.agent", "--engine-url", engine_url,
           "--local-checkpoint-dir", str(local_checkpoint_dir), "--host", host, "--port", str(port)]
    if base_dir is not None:
        cmd += ["--base-dir", str(base_dir)]
    if pre_read_hook:
        cmd += ["--custom-pull-weights-pre-read-hook", pre_read_hook]
    for store in store_dirs:  # the only stores it may read
        cmd += ["--weight-store-dir", str(store)]
    if region:
        cmd += ["--region", region]
    return cmd + list(extra_args)


def _sglang_key_args(spec: EngineSpec) -> dict[str, str]:
    """SGLang's ``--api-key``/``--admin-api-key`` from the keys this process runs with (the agent
    in front of it sends the same ones). SGLang reads keys only from its command line."""
    import os

    from miles_disagg.net.auth import ApiKeys

    keys = ApiKeys.from_env(spec.sglang_env if spec.sglang_env is not None else os.environ)
    pairs = (("api-key", keys.api_key), ("admin-api-key", keys.admin_api_key))
    return {flag: value for flag, value in pairs if value is not None}


def _store_dirs(spec: EngineSpec) -> tuple[str, ...]:
    return (str(spec.store_dir),) if spec.store_dir is not None else ()


def launch_engine(
    model_dir: Path, *, log_path: Path, port: int | None = None, host: str = "127.0.0.1",
    extra_args: Sequence[str] = (), startup_timeout_s: float = BUILTIN_STARTUP_TIMEOUT_S,
) -> LaunchedEngine:
    """Start ``python -m miles_disagg.engines.builtin`` on ``host:port`` (a free port by default);
    returns once it answers ``/health``."""
    port = port or free_port(host)
    cmd = builtin_engine_command(model_dir, host, port, extra_args)
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/health",
                              what="engine", error=EngineUnrecoverable, startup_timeout_s=startup_timeout_s,
                              poll_s=0.2, launched=LaunchedEngine)


def launch_agent(
    engine_url: str, local_checkpoint_dir: Path, *, log_path: Path, port: int | None = None,
    host: str = "127.0.0.1", base_dir: Path | None = None, pre_read_hook: str | None = None,
    store_dirs: Sequence[str] = (), extra_args: Sequence[str] = (), startup_timeout_s: float = AGENT_STARTUP_TIMEOUT_S,
) -> LaunchedEngine:
    """Start ``python -m miles_disagg.engines.agent`` in front of ``engine_url``; returns once it
    answers ``/agent_health`` (which says nothing about its engine)."""
    port = port or free_port(host)
    cmd = agent_command(engine_url, local_checkpoint_dir, host=host, port=port, base_dir=base_dir,
                        pre_read_hook=pre_read_hook, store_dirs=store_dirs, extra_args=extra_args)
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/agent_health",
                              what="agent", error=EngineUnrecoverable, startup_timeout_s=startup_timeout_s,
                              launched=LaunchedEngine)


def launch_sglang(cmd: Sequence[str], *, url: str, log_path: Path, env: dict[str, str] | None = None,
                  startup_timeout_s: float = SGLANG_STARTUP_TIMEOUT_S) -> LaunchedEngine:
    """Start an SGLang server command; returns once ``/health_generate`` answers (its model is
    loaded and can generate)."""
    return start_http_process(cmd, url=url, log_path=log_path, health_path="/health_generate", what="SGLang",
                              error=EngineUnrecoverable, startup_timeout_s=startup_timeout_s, poll_s=2.0,
                              probe_timeout_s=30.0, env=env, launched=LaunchedEngine)
