"""Adapters a replica uses beside the engine port: the version store's head, and the gateway.

(The engine itself is :class:`miles_disagg.engines.client.EngineClient`.) The gateway link
raises ``GatewayUnreachable`` (retryable) and never blocks longer than its timeout.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from miles_disagg.net.auth import ApiKeys
from miles_disagg.net.keyed_client import payload_message, pooled_limits, response_payload, shared_tls_context
from miles_disagg.service.protocol import ReplicaStatus, StoreHead
from miles_disagg.types import InvalidInput, Retryable

HEARTBEAT_TIMEOUT_S = 2.0


class GatewayUnreachable(Retryable):
    """The gateway did not answer; the next heartbeat tries again."""


class StoreView:
    """The store's head, with its publication time (the version index's ``created_unix``,
    else the index file's mtime, for directories written by other producers)."""

    def __init__(self, root: str | Path):
        from miles_disagg.weights.stores import open_store

        self.store = open_store(root)
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


class GatewayLink:
    """Heartbeats and deregistration against the gateway."""

    def __init__(self, url: str, *, timeout_s: float = HEARTBEAT_TIMEOUT_S, keys: ApiKeys | None = None):
        """``keys``: the admin key goes with heartbeats and deregistration; None: the environment's."""
        self.url = url.rstrip("/")
        self.keys = keys if keys is not None else ApiKeys.from_env()
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s, limits=pooled_limits(), trust_env=False,
                                  verify=shared_tls_context())

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
            response = self._http.request(method, path, json=body, headers=self.keys.headers_for(path))
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        payload = response_payload(response)
        if response.status_code in (400, 401, 403, 404, 413, 422):  # what was sent is wrong: retrying will not help
            raise InvalidInput(f"{self.url}{path} answered {response.status_code}: {payload_message(payload)}")
        if not response.is_success:
            raise GatewayUnreachable(f"{self.url}{path} answered {response.status_code}: {payload_message(payload)}")
        return payload if isinstance(payload, dict) else {}
