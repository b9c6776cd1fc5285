"""One managed engine, owned by a Ray actor placed in the engine's first GPU bundle.

``builtin``: the built-in engine (``python -m miles_disagg.engine``) on this node; it
implements ``/pull_weights`` itself. ``sglang``: ``python -m sglang.launch_server`` with
``--tp-size`` GPUs from ``--base-gpu-id``, fronted by ``miles-disagg agent`` (which adds
``/pull_weights``), so the URL handed out is the agent's. Either way the actor returns
one URL that speaks the engine API plus ``/pull_weights``.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from miles_disagg.process import die_with_parent
from miles_disagg.types import EngineUnrecoverable

SGLANG_STARTUP_TIMEOUT_S = 900.0


@dataclass
class EngineSpec:
    index: int
    backend: str  # builtin | sglang
    model_path: str
    log_dir: str
    local_checkpoint_dir: str
    tp_size: int = 1
    dtype: str = "auto"
    seed: int = 0
    max_running_requests: int = 64
    pre_read_hook: str | None = None
    sglang_args: dict = field(default_factory=dict)


class EngineProcess:
    """Ray actor body: start, stop, restart and probe one engine process."""

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self._engine = None
        self._agent = None
        self.url: str | None = None

    def start(self) -> str:
        import ray

        from miles_disagg.engine.launch import free_port

        host = ray.util.get_node_ip_address()
        log_dir = Path(self.spec.log_dir)
        port = free_port(host)
        if self.spec.backend == "sglang":
            self.url = self._start_sglang(host, port, log_dir)
        else:
            self.url = self._start_builtin(host, port, log_dir)
        return self.url

    def _start_builtin(self, host: str, port: int, log_dir: Path) -> str:
        from miles_disagg.engine.launch import launch_engine

        s = self.spec
        args = ["--dtype", s.dtype, "--random-seed", str(s.seed), "--max-running-requests", str(s.max_running_requests)]
        if s.pre_read_hook:
            args += ["--custom-pull-weights-pre-read-hook", s.pre_read_hook]
        self._engine = launch_engine(Path(s.model_path), log_path=log_dir / f"engine-{s.index}.log", host=host,
                                     port=port, extra_args=args)
        return self._engine.url

    def _start_sglang(self, host: str, port: int, log_dir: Path) -> str:
        import ray

        from miles_disagg.agent.launch import launch_agent
        from miles_disagg.rollout.sglang_launch import sglang_command

        s = self.spec
        gpu_ids = ray.get_gpu_ids()
        base_gpu_id = int(gpu_ids[0]) if gpu_ids else 0
        cmd = sglang_command(s.model_path, host=host, port=port, tp_size=s.tp_size, base_gpu_id=base_gpu_id,
                             dtype=s.dtype, weight_version=0, extra_args=s.sglang_args)
        env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}  # SGLang picks GPUs by base id
        log_path = log_dir / f"sglang-{s.index}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self._engine = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent)
        engine_url = f"http://{host}:{port}"
        _wait_health_generate(engine_url, self._engine, log_path)
        self._agent = launch_agent(engine_url, Path(s.local_checkpoint_dir), log_path=log_dir / f"agent-{s.index}.log",
                                   host=host, base_dir=Path(s.model_path), pre_read_hook=s.pre_read_hook)
        return self._agent.url

    def alive(self) -> bool:
        proc = getattr(self._engine, "proc", self._engine)
        return proc is not None and proc.poll() is None

    def pid(self) -> int | None:
        proc = getattr(self._engine, "proc", self._engine)
        return proc.pid if proc is not None else None

    def stop(self) -> None:
        for handle in (self._agent, self._engine):
            if handle is None:
                continue
            if hasattr(handle, "stop"):
                handle.stop()
            elif handle.poll() is None:
                handle.terminate()
                try:
                    handle.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    handle.kill()
        self._engine = self._agent = None

    def restart(self) -> str:
        self.stop()
        return self.start()


def _wait_health_generate(url: str, proc: subprocess.Popen, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + SGLANG_STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineUnrecoverable(f"SGLang exited with {proc.returncode}; see {log_path}:\n"
                                      f"{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health_generate", timeout=30).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2.0)
    proc.kill()
    raise EngineUnrecoverable(f"SGLang at {url} did not pass /health_generate in {SGLANG_STARTUP_TIMEOUT_S:.0f}s")
