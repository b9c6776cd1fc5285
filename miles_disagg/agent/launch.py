"""Start ``miles-disagg agent`` as a subprocess and wait until it answers ``/agent_health``.

The agent's own health says nothing about its engine (the agent starts before or
after it; proxied requests answer 502 while the engine is down). The child's
stdout/stderr go to ``log_path`` so a failed start can show why.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

from miles_disagg.engine.launch import LaunchedEngine
from miles_disagg.process import free_port, start_http_process
from miles_disagg.types import EngineUnrecoverable

DEFAULT_STARTUP_TIMEOUT_S = 60.0


class LaunchedAgent(LaunchedEngine):
    """A running agent process: ``url`` (the agent's), ``proc``, ``log_path``, ``logs()``, ``stop()``."""


def launch_agent(
    engine_url: str, local_checkpoint_dir: Path, *, log_path: Path, port: int | None = None,
    host: str = "127.0.0.1", base_dir: Path | None = None, pre_read_hook: str | None = None,
    extra_args: Sequence[str] = (), startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
) -> LaunchedAgent:
    """Start ``python -m miles_disagg.agent`` on ``host:port`` (a free port by default).

    Raises ``EngineUnrecoverable`` (with the log tail) if the process exits or does not
    answer ``/agent_health`` within ``startup_timeout_s``; the process is stopped then.
    """
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "miles_disagg.agent", "--engine-url", engine_url,
           "--local-checkpoint-dir", str(local_checkpoint_dir), "--host", host, "--port", str(port)]
    if base_dir is not None:
        cmd += ["--base-dir", str(base_dir)]
    if pre_read_hook:
        cmd += ["--custom-pull-weights-pre-read-hook", pre_read_hook]
    cmd += list(extra_args)
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/agent_health",
                              what="agent", error=EngineUnrecoverable, startup_timeout_s=startup_timeout_s,
                              launched=LaunchedAgent)
