"""``RouterClient``: a small synchronous client of the router's registry endpoints.

Errors are typed by what the caller must do: ``InvalidInput`` (400: a bad argument;
``UnknownWorker`` for 404), ``Retryable`` (409/503, or ``RouterUnreachable`` when the
router cannot be reached), ``MilesDisaggError`` for anything else. Every call is bounded
by the client's timeout; the ``wait_*`` helpers poll until their own deadline.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

from miles_disagg.net.auth import ApiKeys
from miles_disagg.net.keyed_client import KeyedHttpClient
from miles_disagg.router.registry import UnknownWorker, normalize_url
from miles_disagg.types import InvalidInput, MilesDisaggError, Retryable, VersionConstraint, VersionNotReady

POLL_S = 0.05


class RouterUnreachable(Retryable):
    """The router did not answer (not started yet, gone, or timed out)."""


class RouterClient(KeyedHttpClient):
    """Registry operations on the router at ``url`` (``http://host:port``); ``keys`` (None: the
    environment's) go per path, the admin key to the registry endpoints."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, keys: ApiKeys | None = None):
        super().__init__(url, timeout_s=timeout_s, keys=keys)

    # ------------------------------------------------------------------ registry

    def add_worker(self, worker_url: str) -> dict:
        """Register a worker; the router probes it once before answering (so a live engine
        comes back ``ready``). Re-adding a registered worker changes nothing."""
        return self._call("POST", "/add_worker", {"url": worker_url})["worker"]

    def remove_worker(self, worker_url: str) -> dict:
        """Unregister a worker (its in-flight requests finish); ``UnknownWorker`` if absent."""
        return self._call("POST", "/remove_worker", {"url": worker_url})["worker"]

    def list_workers(self) -> list[dict]:
        """``[{"url", "weight_version", "state", "outstanding", "healthy", "last_error", "num_served"}]``."""
        return self._call("GET", "/list_workers")["workers"]

    def worker(self, worker_url: str) -> dict:
        url = normalize_url(worker_url)
        for worker in self.list_workers():
            if worker["url"] == url:
                return worker
        raise UnknownWorker(worker_url)

    def set_worker_state(self, worker_url: str, state: str, *, weight_version: int | None = None) -> dict:
        """Mark a worker ``paused``/``activating`` (no new requests) or ``ready``.

        Marking ``ready`` without ``weight_version`` makes the router re-read the engine's
        version before answering, so routing uses the version it holds after an update.
        """
        body: dict[str, Any] = {"url": worker_url, "state": state}
        if weight_version is not None:
            body["weight_version"] = weight_version
        return self._call("POST", "/set_worker_state", body)["worker"]

    def metrics(self) -> dict:
        return self._call("GET", "/metrics")

    # ------------------------------------------------------------------ waiting

    def health(self) -> bool:
        try:
            return self.request("GET", "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until the router answers ``/health``; ``RouterUnreachable`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.health():
            if time.monotonic() > deadline:
                raise RouterUnreachable(f"router at {self.url} not healthy after {timeout_s}s")
            time.sleep(POLL_S)

    def wait_worker_version(self, worker_url: str, version: int, timeout_s: float = 30.0) -> dict:
        """Until the router lists the worker ``ready`` at exactly ``version``; returns its entry.

        Raises ``VersionNotReady`` (with the version last seen) after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            worker = self.worker(worker_url)
            if worker["state"] == "ready" and worker["weight_version"] == version:
                return worker
            if time.monotonic() > deadline:
                seen = [worker["weight_version"]] if worker["weight_version"] is not None else []
                raise VersionNotReady(VersionConstraint(exact_version=version), seen)
            time.sleep(POLL_S)

    # ------------------------------------------------------------------ transport

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            response = self.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise RouterUnreachable(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if response.is_success:
            return response.json()
        message, error_type = _message_of(response)
        if error_type == UnknownWorker.__name__ and body and "url" in body:
            raise UnknownWorker(body["url"])
        if response.status_code in (400, 401, 403, 404, 413, 422):
            raise InvalidInput(f"{method} {path}: {message}")
        if response.status_code in (409, 503):
            raise Retryable(f"{method} {path}: {message}")
        raise MilesDisaggError(f"{method} {path} answered {response.status_code}: {message}")


def _message_of(response: httpx.Response) -> tuple[str, str | None]:
    """The router's error ``message`` and ``type`` (or the raw text for other answers)."""
    try:
        obj = response.json()
        return str(obj.get("message", response.text)), obj.get("type")
    except (ValueError, AttributeError):
        return response.text[:500], None
