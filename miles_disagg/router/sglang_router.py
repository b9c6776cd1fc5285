"""``--router sglang``: sglang-router (``pip install sglang-router``) in front of the engines.

sglang-router balances load but knows nothing of policy versions: requests carry no version
constraint (admission by ``--max-weight-staleness`` is off; the buffer still drops stale
groups when the trainer consumes them), paused workers are not taken out of rotation (their
requests wait in the engine, as SGLang does itself), and the served versions of a sample come
only from the engine's own response. The built-in engine reports
``meta_info.weight_version_start/_end``; stock SGLang reports only ``weight_version`` (at the
end), so with SGLang engines a sample cannot name its start version and the rollout refuses
it rather than guess. Use the built-in router (the default) for version-constrained routing.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx

from miles_disagg.net.process import free_port, start_http_process
from miles_disagg.router.launch import LaunchedRouter, RouterStartFailed
from miles_disagg.types import ConfigError

ROUTER_FLAG = "--router"


def require_sglang_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        raise ConfigError(f"{ROUTER_FLAG} sglang needs sglang-router (pip install sglang-router); "
                          f"or use {ROUTER_FLAG} builtin", (ROUTER_FLAG,))


def launch_sglang_router(*, log_path: Path, workers: Sequence[str], port: int | None = None,
                         host: str = "127.0.0.1", policy: str | None = None,
                         startup_timeout_s: float = 120.0) -> LaunchedRouter:
    """``python -m sglang_router.launch_router`` over ``workers``; waits until it answers."""
    require_sglang_router()
    port = port or free_port(host)
    cmd = sglang_router_command(host=host, port=port, workers=workers, policy=policy)
    return start_http_process(cmd, url=f"http://{host}:{port}", log_path=log_path, health_path="/health",
                              what="sglang-router", error=RouterStartFailed, startup_timeout_s=startup_timeout_s,
                              poll_s=0.2, launched=LaunchedRouter)


def sglang_router_command(*, host: str, port: int | str, workers: Sequence[str], policy: str | None = None) -> list[str]:
    """The argv :func:`launch_sglang_router` runs (``policy``: miles' ``--sglang-router-policy``;
    default round_robin)."""
    return [sys.executable, "-m", "sglang_router.launch_router", "--host", host, "--port", str(port),
            "--policy", policy or "round_robin", "--worker-urls", *workers]


@dataclass
class SglangRouterClient:
    """The registry calls the engine manager makes, in sglang-router's API: ``/workers``
    (``GET``, ``POST {"url"}``, ``DELETE /workers/{id}``) on current releases, else the older
    ``/add_worker?url=`` and ``/remove_worker?url=``."""

    url: str

    def _workers(self) -> list[dict] | None:
        """``[{"id", "url", ...}]`` from ``GET /workers``; None on a release without it."""
        response = httpx.get(f"{self.url}/workers", timeout=10)
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return [w for w in response.json().get("workers", []) if isinstance(w, dict)]

    def add_worker(self, worker_url: str) -> dict:
        workers = self._workers()
        if workers is not None:
            if any(w.get("url") == worker_url for w in workers):
                return {"url": worker_url}
            response = httpx.post(f"{self.url}/workers", json={"url": worker_url}, timeout=60)
        else:
            response = httpx.post(f"{self.url}/add_worker", params={"url": worker_url}, timeout=60)
        if response.status_code >= 400:
            raise RouterStartFailed(f"sglang-router refused worker {worker_url}: {response.status_code} {response.text[:300]}")
        return {"url": worker_url}

    def remove_worker(self, worker_url: str) -> dict:
        workers = self._workers()
        if workers is None:
            httpx.post(f"{self.url}/remove_worker", params={"url": worker_url}, timeout=30)
        for worker in workers or []:
            if worker.get("url") == worker_url and worker.get("id"):
                httpx.delete(f"{self.url}/workers/{worker['id']}", timeout=30)
        return {"url": worker_url}

    def set_worker_state(self, worker_url: str, state: str, **_) -> dict:
        return {"url": worker_url, "state": state}  # sglang-router has no such state: requests queue in the engine

    def wait_worker_version(self, worker_url: str, version: int, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                seen = httpx.get(f"{worker_url}/model_info", timeout=5).json().get("weight_version")
                if str(seen) == str(version):
                    return {"url": worker_url, "weight_version": version}
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RouterStartFailed(f"{worker_url} did not report version {version} in {timeout_s:.0f}s")
            time.sleep(0.2)
