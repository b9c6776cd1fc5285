"""``GatewayClient``: the service endpoints of a gateway, synchronously (pools, bench, tests, trainers).

Errors: ``GatewayUnreachable`` (retryable) when the gateway does not answer or fails;
``VersionNotReady`` when a wait runs out. Every call is bounded by the client's timeout;
the ``wait_*`` helpers poll until their own deadline.
"""

from __future__ import annotations

import time
from typing import Callable

import httpx

from miles_disagg.net.auth import ApiKeys
from miles_disagg.net.keyed_client import KeyedHttpClient
from miles_disagg.service.adapters import GatewayUnreachable
from miles_disagg.types import VersionConstraint, VersionNotReady

POLL_S = 0.05


class GatewayClient(KeyedHttpClient):
    """The gateway's service endpoints; ``keys`` (None: the environment's) go per path, the admin
    key to ``/wake``."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, keys: ApiKeys | None = None):
        super().__init__(url, timeout_s=timeout_s, keys=keys)

    def replicas(self) -> list[dict]:
        """The fleet table: per replica its status (state, weight_version, staged_version, last_error,
        activations, counters), ``lost``, ``heartbeat_age_s`` and its state ``transitions``."""
        return self._call("GET", "/replicas")["replicas"]

    def metrics(self) -> dict:
        """``GET /service_metrics`` (see :mod:`miles_disagg.service.gateway`)."""
        return self._call("GET", "/service_metrics")

    def service_info(self) -> dict:
        """What the replicas serve (:data:`~miles_disagg.service.protocol.SERVICE_INFO_PATH`): full-weight
        versions, or the LoRA adapter versions of one chain; a gateway that does not say serves full weights."""
        from miles_disagg.service.protocol import SERVICE_INFO_PATH

        try:
            response = self.request("GET", SERVICE_INFO_PATH)
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(f"GET {self.url}{SERVICE_INFO_PATH}: {type(exc).__name__}: {exc}") from exc
        if response.status_code == 404:
            return {"serves": "full_weight_versions", "lora_base_dir": None}
        if not response.is_success:
            raise GatewayUnreachable(f"GET {self.url}{SERVICE_INFO_PATH} answered {response.status_code}: "
                                     f"{response.text[:300]}")
        answer = response.json()
        return answer if isinstance(answer, dict) else {}

    def wake(self) -> dict:
        """Ask every replica to reconcile now; ``{"woken": [...], "failed": {...}}``."""
        return self._call("POST", "/wake")

    def workers(self) -> list[dict]:
        return self._call("GET", "/list_workers")["workers"]

    def wait_for(self, predicate: Callable[[list[dict]], bool], timeout_s: float, what: str) -> list[dict]:
        """Poll ``/replicas`` until ``predicate(replicas)``; ``TimeoutError`` naming ``what`` otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                replicas = self.replicas()
                if predicate(replicas):
                    return replicas
            except GatewayUnreachable:
                replicas = []
            if time.monotonic() > deadline:
                raise TimeoutError(f"gateway {self.url}: timed out after {timeout_s}s waiting for {what}; "
                                   f"replicas: {[_brief(r) for r in replicas]}")
            time.sleep(POLL_S)

    def wait_converged(self, version: int, *, num_replicas: int | None = None, timeout_s: float = 120.0) -> list[dict]:
        """Until every live replica (at least ``num_replicas`` of them) is ready at ``version`` or newer.

        Raises ``VersionNotReady`` (with the versions seen) when ``timeout_s`` runs out.
        """
        def converged(replicas: list[dict]) -> bool:
            live = [r for r in replicas if not r["lost"] and r["state"] != "draining"]
            enough = len(live) >= (num_replicas or 1)
            return enough and all(r["state"] == "ready" and (r["weight_version"] or 0) >= version for r in live)

        try:
            return self.wait_for(converged, timeout_s, f"every replica ready at v{version}+")
        except TimeoutError:
            seen = sorted({r["weight_version"] for r in self.replicas() if r["weight_version"] is not None})
            raise VersionNotReady(VersionConstraint(min_version=version), seen) from None

    def _call(self, method: str, path: str) -> dict:
        try:
            response = self.request(method, path)
        except httpx.HTTPError as exc:
            raise GatewayUnreachable(f"{method} {self.url}{path}: {type(exc).__name__}: {exc}") from exc
        if not response.is_success:
            raise GatewayUnreachable(f"{method} {self.url}{path} answered {response.status_code}: {response.text[:300]}")
        return response.json()


def check_service_serves(url: str, lora_base_dir: str | None, *, flag: str = "--rollout-service-url") -> None:
    """Before step 1: ``ConfigError`` (one line naming ``flag``) when the service at ``url`` does not
    serve what the run publishes (:func:`~miles_disagg.fleet.vetting.service_lora_problems`)."""
    from miles_disagg.fleet.vetting import service_lora_problems
    from miles_disagg.types import ConfigError

    with GatewayClient(url, timeout_s=10.0) as client:
        try:
            info = client.service_info()
        except GatewayUnreachable as exc:
            raise ConfigError(f"{flag} {url}: cannot read what the service serves ({exc})", (flag,)) from None
    problems = service_lora_problems(lora_base_dir, info)
    if problems:
        raise ConfigError(f"{flag} {url}: {'; '.join(problems)}", (flag,))


def wake_replicas(url: str) -> None:
    """``POST /wake`` (its admin key from the environment), best effort: replicas also poll the store."""
    with GatewayClient(url, timeout_s=5.0) as client:
        try:
            client.wake()
        except GatewayUnreachable:
            pass


def _brief(replica: dict) -> str:
    return f"{replica['replica_id']}:{replica['state']}@v{replica['weight_version']}"
