"""The one engine a replica runs or attaches to (``--engine builtin|sglang|url:http://H:P``).

* ``builtin``: the built-in engine (``python -m miles_disagg.engine``) on the base
  checkpoint, at version 0; it implements ``/pull_weights`` itself.
* ``sglang``: ``python -m sglang.launch_server`` on the base checkpoint (``--weight-version
  0``), fronted by ``miles-disagg agent`` on the same host (the agent adds
  ``/pull_weights``); the replica talks to the agent.
* ``url:http://H:P``: an engine someone else runs (it must speak the engine API plus
  ``/pull_weights``: a built-in engine or an agent). Its weights are of unknown version
  until the replica's first activation, and the replica cannot restart it.

Managed engines are children of the replica process (same process group; SIGTERM when the
replica dies), so a replica never leaves its engine behind.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.types import ConfigError, EngineUnrecoverable, VersionRef

ENGINE_FLAG = "--engine"
SGLANG_STARTUP_TIMEOUT_S = 900.0
BUILTIN_STARTUP_TIMEOUT_S = 300.0


def parse_engine(value: str) -> tuple[str, str | None]:
    """``(kind, attach_url)`` from ``--engine``; ``ConfigError`` naming the flag otherwise."""
    if value in ("builtin", "sglang"):
        return value, None
    if value.startswith("url:"):
        from miles_disagg.router.registry import normalize_url
        from miles_disagg.types import InvalidInput

        try:
            return "url", normalize_url(value[len("url:"):])
        except InvalidInput as exc:
            raise ConfigError(f"{ENGINE_FLAG} {value!r}: {exc}", flags=(ENGINE_FLAG,)) from None
    raise ConfigError(f"{ENGINE_FLAG} must be builtin, sglang or url:http://HOST:PORT, got {value!r}", flags=(ENGINE_FLAG,))


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """How a replica gets its engine."""

    kind: str
    """``builtin``, ``sglang`` or ``url``."""
    base_dir: Path
    """The base checkpoint (version 0): what a managed engine starts from."""
    local_checkpoint_dir: Path
    """Host-local checkpoint that ``/pull_weights`` materializes into (the agent's, for SGLang)."""
    log_dir: Path
    """Where the engine (and agent) logs go."""
    host: str = "127.0.0.1"
    """Address a managed engine binds."""
    attach_url: str | None = None
    """The engine's URL when ``kind == "url"``."""
    pre_read_hook: str | None = None
    """``module:function`` run before a pull reads the store (object-store mounts)."""
    engine_args: tuple[str, ...] = ()
    """Extra arguments for the engine command line (built-in engine or SGLang)."""
    tp_size: int = 1
    """SGLang tensor-parallel size."""
    base_gpu_id: int = 0
    """SGLang's first GPU."""
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kind not in ("builtin", "sglang", "url"):
            raise ValueError(f"kind must be builtin, sglang or url, got {self.kind!r}")
        if (self.kind == "url") != (self.attach_url is not None):
            raise ValueError("attach_url is given exactly when kind == 'url'")


@dataclass
class RunningEngine:
    """The engine as the replica sees it: its URL, what it holds at start, and its processes."""

    url: str
    live_at_start: VersionRef | None  # the base (v0) for a fresh managed engine; None when attached
    processes: tuple  # LaunchedProcess-like objects with proc/stop(), engine first; () when attached

    @property
    def managed(self) -> bool:
        return bool(self.processes)

    def exit_code(self) -> int | None:
        """The first managed process's exit code if one has exited, else None."""
        for handle in self.processes:
            code = handle.proc.poll()
            if code is not None:
                return code
        return None

    def stop(self) -> None:
        for handle in reversed(self.processes):
            handle.stop()


def start_engine(spec: EngineSpec) -> RunningEngine:
    """Start (or attach to) the engine; ``EngineUnrecoverable`` with the log tail if it does not come up."""
    if spec.kind == "url":
        return RunningEngine(spec.attach_url, None, ())
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    if spec.kind == "builtin":
        return _start_builtin(spec)
    return _start_sglang(spec)


def _start_builtin(spec: EngineSpec) -> RunningEngine:
    from miles_disagg.engine.launch import launch_engine
    from miles_disagg.process import free_port

    port = free_port(spec.host)
    args = ["--dtype", spec.dtype, *(["--custom-pull-weights-pre-read-hook", spec.pre_read_hook]
                                     if spec.pre_read_hook else []), *spec.engine_args]
    engine = launch_engine(spec.base_dir, log_path=spec.log_dir / f"engine-{port}.log", host=spec.host, port=port,
                           extra_args=args, startup_timeout_s=BUILTIN_STARTUP_TIMEOUT_S)
    return RunningEngine(engine.url, VersionRef("", 0), (engine,))


def _start_sglang(spec: EngineSpec) -> RunningEngine:
    from miles_disagg.agent.launch import launch_agent
    from miles_disagg.process import LaunchedProcess, die_with_parent, free_port
    from miles_disagg.rollout.sglang_launch import sglang_command

    port = free_port(spec.host)
    cmd = sglang_command(str(spec.base_dir), host=spec.host, port=port, tp_size=spec.tp_size,
                         base_gpu_id=spec.base_gpu_id, dtype=spec.dtype, weight_version=0) + list(spec.engine_args)
    log_path = spec.log_dir / f"sglang-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                preexec_fn=die_with_parent)
    engine = LaunchedProcess(f"http://{spec.host}:{port}", proc, log_path)
    try:
        _wait_generate_ready(engine)
        agent = launch_agent(engine.url, spec.local_checkpoint_dir, log_path=spec.log_dir / f"agent-{port}.log",
                             host=spec.host, base_dir=spec.base_dir, pre_read_hook=spec.pre_read_hook)
    except BaseException:
        engine.stop()
        raise
    return RunningEngine(agent.url, VersionRef("", 0), (engine, agent))


def _wait_generate_ready(engine) -> None:
    """Until SGLang answers ``/health_generate`` (its model is loaded and can generate)."""
    import httpx

    deadline = time.monotonic() + SGLANG_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if engine.proc.poll() is not None:
            raise EngineUnrecoverable(f"SGLang exited with {engine.proc.returncode}:\n{engine.logs()[-3000:]}")
        try:
            if httpx.get(f"{engine.url}/health_generate", timeout=30, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    raise EngineUnrecoverable(f"SGLang at {engine.url} not ready after {SGLANG_STARTUP_TIMEOUT_S:.0f}s")
