"""Helpers for the rollout-service tests: hooks that hold a phase, a constrained load, checks.

Hooks (``service_fixtures:hold_pull`` runs in engines before a pull reads the store;
``service_fixtures:hold_phase`` runs in replicas at each phase) do nothing unless the
test created a gate file in ``$MILES_DISAGG_TEST_HOOK_DIR``: ``hold-NAME`` holds every
process, ``hold-NAME-PID`` holds one. A held process first writes
``held-NAME-PID-VERSION``, then waits for its gates to go. So a test drives "a replica is
killed while it stages" with files, not sleeps. This module is imported by those
processes: keep its top-level imports light.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HOOK_DIR_ENV = "MILES_DISAGG_TEST_HOOK_DIR"
HOLD_LIMIT_S = 120.0
HERE = Path(__file__).resolve().parent


def hold_pull(source_dir: str, target_version: int) -> None:
    _hold("pull", target_version)


def hold_phase(phase: str, version: int) -> None:
    _hold(phase, version)


def _hold(name: str, version: int) -> None:
    directory = os.environ.get(HOOK_DIR_ENV)
    if not directory:
        return
    gates = [Path(directory) / f"hold-{name}", Path(directory) / f"hold-{name}-{os.getpid()}"]
    if not any(g.exists() for g in gates):
        return
    (Path(directory) / f"held-{name}-{os.getpid()}-{version}").touch()
    deadline = time.monotonic() + HOLD_LIMIT_S
    while any(g.exists() for g in gates) and time.monotonic() < deadline:
        time.sleep(0.01)


class Gates:
    """The test side of the hooks."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)

    def hold(self, name: str, pid: int | None = None) -> None:
        (self.dir / (f"hold-{name}" if pid is None else f"hold-{name}-{pid}")).touch()

    def release(self, name: str, pid: int | None = None) -> None:
        (self.dir / (f"hold-{name}" if pid is None else f"hold-{name}-{pid}")).unlink(missing_ok=True)

    def release_all(self) -> None:
        for gate in self.dir.glob("hold-*"):
            gate.unlink(missing_ok=True)
        for marker in self.dir.glob("held-*"):
            marker.unlink(missing_ok=True)

    def held(self, name: str) -> dict[int, int]:
        """``{pid: version}`` of processes that reached the gate ``name``."""
        found = {}
        for marker in self.dir.glob(f"held-{name}-*"):
            pid, version = marker.name.rsplit("-", 2)[-2:]
            found[int(pid)] = int(version)
        return found

    def wait_held(self, name: str, count: int, timeout_s: float = 60.0) -> dict[int, int]:
        from engine_fixtures import wait_until

        wait_until(lambda: len(self.held(name)) >= count, timeout=timeout_s, what=f"{count} processes held at {name}")
        return self.held(name)


def hook_env(gates: Gates) -> dict[str, str]:
    """Environment for replicas so they (and their engines) can import the hooks."""
    pythonpath = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": pythonpath, HOOK_DIR_ENV: str(gates.dir), "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def replica_of_pid(service, pid: int) -> str:
    """The id of the local-service replica whose process group contains ``pid``."""
    group = os.getpgid(pid)
    for replica_id in service.replica_ids():
        if service.replica(replica_id).proc.pid == group:
            return replica_id
    raise AssertionError(f"pid {pid} belongs to no replica of the service")


def replica_entry(client, replica_id: str) -> dict:
    return next(r for r in client.replicas() if r["replica_id"] == replica_id)


# --------------------------------------------------------------------------- requests


def body(max_new_tokens: int = 8, seed: int = 0, *, greedy: bool = False, **extra: Any) -> dict:
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    params.update({"temperature": 0.0} if greedy else {"temperature": 1.0, "sampling_seed": seed})
    return {"input_ids": [5, 6, 7, 8], "sampling_params": params, **extra}


def post(http, url: str, payload: dict):
    response = http.post(f"{url}/generate", json=payload)
    try:
        return response.status_code, response.json(), response.headers
    except ValueError:
        return response.status_code, response.text, response.headers


def serve_until_ok(url: str, payload: dict, timeout_s: float = 60.0) -> tuple[dict, int]:
    """POST until 200, retrying retryable refusals as a rollout client does; (answer, refusals)."""
    import httpx

    from engine_fixtures import wait_until

    result: dict[str, Any] = {"refused": 0}

    def attempt() -> bool:
        status, answer, _ = post(http, url, payload)
        if status == 200:
            result["answer"] = answer
            return True
        assert status in (409, 503) and answer["retryable"] is True, (status, answer)
        result["refused"] += 1
        return False

    with httpx.Client(timeout=60.0, trust_env=False) as http:
        wait_until(attempt, timeout=timeout_s, what=f"a 200 for {payload.get('weight_version')}")
    return result["answer"], result["refused"]


def greedy_by_engine(client, version: int, max_new_tokens: int = 12) -> dict[str, list[int]]:
    """Greedy output of every ready engine at exactly ``version``, asked directly (not routed)."""
    import httpx

    outputs = {}
    with httpx.Client(timeout=60.0, trust_env=False) as http:
        for replica in client.replicas():
            assert replica["state"] == "ready" and replica["weight_version"] == version, replica
            status, answer, _ = post(http, replica["engine_url"], body(max_new_tokens, greedy=True))
            assert status == 200, answer
            assert int(answer["meta_info"]["weight_version_start"]) == version  # the engine says "N"
            outputs[replica["replica_id"]] = answer["output_ids"]
    return outputs


@dataclass
class Answer:
    constraint: dict
    status: int | None
    body: Any = None
    error: str | None = None


@dataclass
class ConstrainedLoad:
    """``concurrency`` threads posting to the gateway until ``stop()``; each request's constraint
    comes from ``constraint()`` at send time (e.g. the newest published version minus the staleness)."""

    url: str
    concurrency: int
    constraint: Callable[[], dict]
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        from miles_disagg.bench.loadgen import RequestThreads

        self._threads = RequestThreads(self.concurrency, self._request, timeout_s=60.0)

    @property
    def answers(self) -> list[Answer]:
        return self._threads.records

    def _request(self, http, worker: int, n: int) -> Answer:
        import httpx

        constraint = self.constraint()
        try:
            status, answer, _ = post(http, self.url, body(self.max_new_tokens, seed=worker * 10_000 + n,
                                                          weight_version=constraint))
            record = Answer(constraint, status, answer)
        except httpx.HTTPError as exc:
            record = Answer(constraint, None, error=f"{type(exc).__name__}: {exc}")
        if record.status != 200:
            time.sleep(0.05)
        return record

    def count(self) -> int:
        return self._threads.count()

    def stop(self) -> list[Answer]:
        return self._threads.stop(90)


def check_answers(answers: list[Answer]) -> dict[str, int]:
    """Every answer is a 200 whose served versions satisfy its constraint, or a retryable refusal;
    nothing is lost (no client-side failure). Returns counts by status."""
    counts: dict[str, int] = {}
    for a in answers:
        assert a.status is not None, f"request lost: {a.error}"
        counts[str(a.status)] = counts.get(str(a.status), 0) + 1
        if a.status != 200:
            assert a.status in (409, 502, 503) and a.body["retryable"] is True, (a.status, a.body)
            continue
        meta = a.body["meta_info"]
        start, end = meta["weight_version_start"], meta["weight_version_end"]
        assert isinstance(start, int) and isinstance(end, int) and start <= end, meta
        if "exact_version" in a.constraint:
            assert start == a.constraint["exact_version"], (a.constraint, meta)
        else:
            assert start >= a.constraint["min_version"], (a.constraint, meta)
    return counts


# --------------------------------------------------------------------------- publishing


class Publisher:
    """Publishes versions of the tiny model (large enough changes that greedy outputs move)."""

    def __init__(self, store_dir: Path, base_dir: Path, noise: float = 0.05, post_write_hook: Callable | None = None):
        from rollout_fixtures import load_tensors

        from miles_disagg.weights.publisher import DeltaPublisher

        self.tensors = load_tensors(base_dir)
        self.publisher = DeltaPublisher(store_dir, base_dir=base_dir, post_write_hook=post_write_hook)
        self.publisher.capture_baseline()
        self.noise = noise
        self.latest = self.publisher.latest.version if self.publisher.latest else 0

    def publish(self) -> int:
        import torch

        generator = torch.Generator().manual_seed(1000 + self.latest)
        for name, tensor in self.tensors.items():
            self.tensors[name] = tensor + self.noise * torch.randn(tensor.shape, generator=generator, dtype=tensor.dtype)
        self.latest = self.publisher.publish(self.tensors.items()).ref.version
        return self.latest

    def close(self) -> None:
        self.publisher.close()


def corrupt_payload(version_dir: str) -> None:
    """Flip the last byte of a version's first payload file (its data, not its header)."""
    payload = sorted(Path(version_dir).glob("model-*.safetensors"))[0]
    data = bytearray(payload.read_bytes())
    data[-1] ^= 0xFF
    payload.write_bytes(bytes(data))
