"""Adapters behind the reconciler's ports: the version store, the engine's HTTP API, the gateway.

Engine errors are typed by what the replica must do (the engine answers with the
statuses of :mod:`miles_disagg.httpjson`): ``StagingRefused`` (400: lineage, checksum,
layout or format refused; nothing live changed), ``Retryable`` (409: e.g. the version is
not visible yet), ``EngineUnreachable`` (no answer: the engine is down or hung),
``EngineUnrecoverable`` (5xx). The gateway link raises ``GatewayUnreachable`` (retryable)
and never blocks longer than its timeout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx

from miles_disagg.router.registry import parse_version
from miles_disagg.service.protocol import ReplicaStatus, StoreHead
from miles_disagg.types import EngineUnrecoverable, FailRun, InvalidInput, MilesDisaggError, Retryable

PULL_TIMEOUT_S = 1800.0
CONTROL_TIMEOUT_S = 120.0
LOAD_TIMEOUT_S = 1.0  # a heartbeat never waits long for the load figure
HEARTBEAT_TIMEOUT_S = 2.0


class StagingRefused(FailRun):
    """The engine refused to stage a version (lineage, checksum, layout or format); nothing changed."""


class EngineUnreachable(EngineUnrecoverable):
    """The engine did not answer (down, restarting or hung)."""


class GatewayUnreachable(Retryable):
    """The gateway did not answer; the next heartbeat tries again."""


class StoreView:
    """The store's head, with its publication time (the version index's ``created_unix``,
    else the index file's mtime, for directories written by other producers)."""

    def __init__(self, root: str | Path):
        from miles_disagg.weights.store import VersionStore

        self.store = VersionStore(root)
        self._published: dict[tuple[str, int], float | None] = {}

    def head(self) -> StoreHead | None:
        ref = self.store.latest()
        if ref is None:
            return None
        key = (ref.run_id, ref.version)
        if key not in self._published:
            self._published[key] = self._published_unix(ref.version)
        return StoreHead(ref.version, ref.run_id, self._published[key])

    def _published_unix(self, version: int) -> float | None:
        from miles_disagg.weights.format import INDEX_NAME

        if version == 0:
            return None
        created = self.store.read_index(version).extra.get("created_unix")
        try:
            return float(created)
        except (TypeError, ValueError):
            return os.stat(self.store.version_dir(version) / INDEX_NAME).st_mtime


class HttpEngine:
    """The engine's control API (built-in engine, or ``miles-disagg agent`` in front of SGLang)."""

    def __init__(self, url: str, *, store_dir: str | Path, local_checkpoint_dir: str | Path):
        self.url = url.rstrip("/")
        self.store_dir = os.path.abspath(store_dir)
        self.local_dir = os.path.abspath(local_checkpoint_dir)  # not resolve(): it is a symlink
        self._http = httpx.Client(base_url=self.url, timeout=CONTROL_TIMEOUT_S, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def pull(self, version: int) -> None:
        self._call("POST", "/pull_weights", {"target_version": version, "source_dir": self.store_dir,
                                             "local_checkpoint_dir": self.local_dir}, timeout=PULL_TIMEOUT_S)

    def pause(self, mode: str) -> None:
        self._call("POST", "/pause_generation", {"mode": mode})

    def flush(self) -> None:
        self._call("POST", "/flush_cache", {})

    def load(self, version: int) -> None:
        self._call("POST", "/update_weights_from_disk", {"model_path": self.local_dir, "weight_version": str(version)})

    def resume(self) -> None:
        self._call("POST", "/continue_generation", {})

    def version(self) -> int | None:
        return parse_version(self._call("GET", "/get_weight_version").get("weight_version"))

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def load_count(self) -> int | None:
        """Requests running or queued in the engine (built-in engine's server info); None if unknown."""
        try:
            states = self._call("GET", "/get_server_info", timeout=LOAD_TIMEOUT_S).get("internal_states") or [{}]
            running, waiting = states[0].get("num_running_requests"), states[0].get("num_waiting_requests")
            return int(running) + int(waiting) if running is not None and waiting is not None else None
        except (MilesDisaggError, ValueError, TypeError, AttributeError):
            return None

    def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        try:
            kwargs: dict[str, Any] = {"json": body} if body is not None else {}
            if timeout is not None:
                kwargs["timeout"] = timeout
            response = self._http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        payload = _json(response)
        if response.status_code == 200 and not (isinstance(payload, dict) and payload.get("success") is False):
            return payload if isinstance(payload, dict) else {}
        message = f"{self.url}{path} answered {response.status_code}: {_message(payload)}"
        if response.status_code in (400, 404, 422):
            raise StagingRefused(message) if path == "/pull_weights" else InvalidInput(message)
        if response.status_code == 409:
            raise Retryable(message)
        raise EngineUnrecoverable(message)


class GatewayLink:
    """Heartbeats and deregistration against the gateway."""

    def __init__(self, url: str, *, timeout_s: float = HEARTBEAT_TIMEOUT_S):
        self.url = url.rstrip("/")
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, trust_env=False)

    def close(self) -> None:
        self._http.close()

    def report(self, status: ReplicaStatus) -> dict:
        return self._call("POST", "/heartbeat", status.to_json())

    def deregister(self, replica_id: str) -> dict:
        return self._call("POST", "/deregister", {"replica_id": replica_id})

    def outstanding(self, engine_url: str) -> int:
        """Requests the gateway has in flight on ``engine_url`` (0 when it does not list it)."""
        for worker in self._call("GET", "/list_workers").get("workers", []):
            if worker.get("url") == engine_url:
                return int(worker.get("outstanding", 0))
        return 0

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            response = self._http.request(method, path, json=body) if body is not None else self._http.request(method, path)
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        payload = _json(response)
        if response.status_code in (400, 404, 422):  # what was sent is wrong: retrying will not help
            raise InvalidInput(f"{self.url}{path} answered {response.status_code}: {_message(payload)}")
        if not response.is_success:
            raise GatewayUnreachable(f"{self.url}{path} answered {response.status_code}: {_message(payload)}")
        return payload if isinstance(payload, dict) else {}


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:500]


def _message(payload: Any) -> str:
    if isinstance(payload, dict):
        error = payload.get("error")
        return str(payload.get("message") or (error.get("message") if isinstance(error, dict) else error) or payload)
    return str(payload)
