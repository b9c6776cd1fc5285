"""Helpers for the rollout-topology tests: a private Ray session, checkpoint copies, versions
to publish, an engine manager that records the update lifecycle, and a load generator.

Ray runs with logical GPUs (no CUDA needed). Its temp dir lives directly under /tmp: Ray's
unix sockets sit below it and socket paths must stay under ~107 characters. Ray workers get
this directory on ``PYTHONPATH`` so actors defined here (``RecordingManager``) import there.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import httpx

from miles_disagg.engines.client import EngineClient
from miles_disagg.fleet.manager import EngineManager
from miles_disagg.engines.updater import DiskDeltaUpdater
from miles_disagg.net.netbind import LOCAL_RAY_SYSTEM_CONFIG

HERE = Path(__file__).resolve().parent
RETRYABLE_STATUSES = (409, 502, 503)


@contextlib.contextmanager
def ray_session(num_gpus: int = 8) -> Iterator[None]:
    """A private local Ray with ``num_gpus`` logical GPUs, shut down (and its temp dir removed) on exit."""
    import ray

    os.environ["RAY_AUTH_MODE"] = "disabled"
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # The raylet, and so every worker, inherits this process's environment (tests/conftest.py sets
    # the thread counts): only PYTHONPATH is added, for the start. A job-wide runtime_env would
    # start every worker through Ray's setup_worker instead (about half a CPU-second more each).
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    with _environment(PYTHONPATH=pythonpath):
        ray.init(num_cpus=8, num_gpus=num_gpus, include_dashboard=False, _temp_dir=temp_dir,
                 logging_level="WARNING", _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        # Ray's exiting workers may still write logs there; remove what they leave at exit
        atexit.register(shutil.rmtree, temp_dir, ignore_errors=True)


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def checkpoint_copy(source: Path, target: Path, **config_overrides: Any) -> Path:
    """A copy of an HF checkpoint directory whose ``config.json`` has ``config_overrides`` applied."""
    shutil.copytree(source, target)
    config_path = target / "config.json"
    config = json.loads(config_path.read_text())
    config.update(config_overrides)
    config_path.write_text(json.dumps(config, indent=1))
    return target


def load_tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


class VersionSource:
    """Publishes versions of the tiny model (every tensor plus a little noise) onto a store."""

    def __init__(self, store_dir: Path, base_dir: Path):
        from miles_disagg.weights.publisher import DeltaPublisher

        self.tensors = load_tensors(base_dir)
        self.publisher = DeltaPublisher(store_dir, base_dir=base_dir)
        self.publisher.capture_baseline()

    def publish_next(self, seed: int) -> int:
        import torch

        generator = torch.Generator().manual_seed(seed)
        for name, tensor in self.tensors.items():
            self.tensors[name] = tensor + 1e-3 * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        return self.publisher.publish(self.tensors.items()).ref.version

    def close(self) -> None:
        self.publisher.close()


# --------------------------------------------------------------------------- lifecycle recording


class RecordingUpdater(DiskDeltaUpdater):
    """A ``DiskDeltaUpdater`` that appends what it did, and what the engine said, to ``log``.

    ``("prepared", url, staged_version, num_running_requests)`` right after an engine's
    ``/pull_weights`` returned;
    ``("paused", url, staged_version, paused_mode)`` when the router is told to stop routing
    to the engine, i.e. before ``/pause_generation``. The engine-side values come from its
    ``/get_server_info``, so the order is observed on the engine, not just in this class.
    """

    def __init__(self, *args, log: list, **kwargs):
        self.log = log
        outer_set_state = kwargs.pop("set_state", None)
        super().__init__(*args, set_state=self._record_state, **kwargs)
        self._outer_set_state = outer_set_state or (lambda url, state: None)

    async def prepare_one(self, index: int, engine, version: int) -> None:
        import asyncio

        await super().prepare_one(index, engine, version)
        url = self.clients[index].url
        state = await asyncio.to_thread(_engine_state, url)
        self.log.append(("prepared", url, state["staged_version"], state["num_running_requests"]))

    def _record_state(self, url: str, state: str) -> None:
        if state == "paused":
            engine = _engine_state(url)
            self.log.append(("paused", url, engine["staged_version"], engine["paused_mode"]))
        else:
            self.log.append((state, url))
        self._outer_set_state(url, state)


def _engine_state(url: str) -> dict:
    client = EngineClient(url, timeout_s=10)
    try:
        return client.get("/get_server_info")["internal_states"][0]
    finally:
        client.close()


class RecordingManager(EngineManager):
    """``EngineManager`` whose full-fleet updates are recorded (``update_log()``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._update_log: list = []

    def _updater(self, indices: list[int] | None = None, **kwargs) -> DiskDeltaUpdater:
        if indices is not None and len(indices) < len(self.engine_urls):  # restores of one engine are not recorded
            return super()._updater(indices, **kwargs)
        return RecordingUpdater(list(self.engine_urls), store_dir=self.weights.update_weight_disk_dir,
                                local_dirs=list(self.local_dirs), pause_mode=self.rollout.pause_generation_mode,
                                set_state=self._set_state, log=self._update_log)

    def update_log(self) -> list:
        return list(self._update_log)


# --------------------------------------------------------------------------- generation load


def long_body(max_new_tokens: int, seed: int, **extra: Any) -> dict:
    return {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 1.0,
                                                           "ignore_eos": True, "sampling_seed": seed}, **extra}


@dataclass
class Answer:
    sent_at: float
    done_at: float
    status: int | None  # None: the client timed out or the connection failed
    body: Any = None
    error: str | None = None


@dataclass
class Load:
    """``concurrency`` client threads posting ``/generate`` to the router until ``stop()``
    (``once=True``: one request each). Every answer (or client-side failure) is kept."""

    router_url: str
    concurrency: int
    max_new_tokens: int
    timeout_s: float = 60.0
    once: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        from miles_disagg.bench.loadgen import RequestThreads

        self._threads = RequestThreads(self.concurrency, self._request, base_url=self.router_url,
                                       timeout_s=self.timeout_s, once=self.once)

    @property
    def answers(self) -> list[Answer]:
        return self._threads.records

    def _request(self, http, worker: int, n: int) -> Answer:
        body = long_body(self.max_new_tokens, seed=worker * 1000 + n, **self.extra)
        sent = time.monotonic()
        try:
            response = http.post("/generate", json=body)
            return Answer(sent, time.monotonic(), response.status_code, _json(response))
        except httpx.HTTPError as exc:
            return Answer(sent, time.monotonic(), None, error=f"{type(exc).__name__}: {exc}")

    def stop(self, timeout_s: float | None = None) -> list[Answer]:
        """Stop sending, wait for the requests in flight; returns every answer."""
        return self._threads.stop(timeout_s)


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def running_requests(url: str) -> int:
    try:
        return int(_engine_state(url)["num_running_requests"])
    except Exception:  # a dead engine runs nothing
        return 0
