"""The engine port: one synchronous client for an engine's SGLang-style API plus ``/pull_weights``.

Used wherever this project talks to an engine: the managed and attached rollout (engine
manager, weight updaters) and the service replicas. The URL is the engine itself (built-in
engine) or its ``miles-disagg agent`` (stock SGLang).

Every call checks the HTTP status and the ``success`` field SGLang puts in weight-update
answers, so no failure is ever mistaken for success. Errors are typed by what the caller
must do:

* :class:`~miles_disagg.types.EngineUnreachable` - no answer (down, restarting, hung);
* :class:`StagingRefused` - ``/pull_weights`` refused the version (lineage, checksum,
  layout or format); nothing live changed;
* :class:`EngineRefused` - any other 4xx: what was sent is wrong; nothing changed;
* :class:`EngineBusy` - 409: retry later (e.g. the version is not visible yet);
* :class:`~miles_disagg.types.EngineUnrecoverable` - a 5xx or a ``success: false``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from miles_disagg.weights.location import normalize_store
from miles_disagg.net.auth import ApiKeys, level_of
from miles_disagg.net.keyed_client import KeyedHttpClient, payload_message, response_payload
from miles_disagg.types import EngineUnreachable, EngineUnrecoverable, FailRun, InvalidInput, MilesDisaggError, Retryable

CONTROL_TIMEOUT_S = 600.0
PULL_TIMEOUT_S = 1800.0
PROBE_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 1.0  # a heartbeat never waits long for the load figure


class StagingRefused(FailRun):
    """The engine refused to stage a version (lineage, checksum, layout or format); nothing changed."""


class EngineRefused(InvalidInput):
    """The engine refused a request as malformed or not applicable (4xx); nothing changed."""


class EngineBusy(Retryable):
    """The engine cannot do this now (409); try again later."""


class EngineClient(KeyedHttpClient):
    """One engine. ``store_dir`` and ``local_checkpoint_dir`` are needed only for :meth:`pull`
    and :meth:`load` (the version store, and the host-local checkpoint the engine serves from)."""

    def __init__(self, url: str, *, store_dir: str | Path | None = None,
                 local_checkpoint_dir: str | Path | None = None, timeout_s: float = CONTROL_TIMEOUT_S,
                 keys: ApiKeys | None = None):
        super().__init__(url, timeout_s=timeout_s, keys=keys)
        self.store_dir = normalize_store(store_dir) if store_dir is not None else None
        # not resolve(): the local checkpoint is a symlink the materializer flips
        self.local_dir = os.path.abspath(local_checkpoint_dir) if local_checkpoint_dir is not None else None
        self.one_call_activation = False  # the last pull's answer announced /activate_weights

    # ------------------------------------------------------------------ weights lifecycle

    def pull(self, version: int) -> dict[str, Any]:
        """Materialize and verify ``version`` on the engine's host while it keeps serving."""
        from miles_disagg.engines.activation import offers_one_call

        answer = self.post("/pull_weights", {"target_version": version, "source_dir": self._need("store_dir"),
                                             "local_checkpoint_dir": self._need("local_dir")}, timeout_s=PULL_TIMEOUT_S)
        self.one_call_activation = offers_one_call(answer)
        return answer

    def activate_in_one_call(self, version: int, pause_mode: str, flush: bool) -> dict[str, Any]:
        """``/activate_weights``: the engine pauses, loads the prepared ``version``, continues and checks."""
        from miles_disagg.engines.activation import ACTIVATE_PATH

        return self.post(ACTIVATE_PATH, {"model_path": self._need("local_dir"), "weight_version": str(version),
                                         "pause_mode": pause_mode, "flush_cache": flush})

    def pause(self, mode: str) -> None:
        self.post("/pause_generation", {"mode": mode})

    def load_lora_adapter(self, name: str, path: str, pinned: bool = False) -> dict[str, Any]:
        """SGLang's ``/load_lora_adapter``: the adapter directory ``path`` served as ``name`` (while it generates)."""
        return self.post("/load_lora_adapter", {"lora_name": name, "lora_path": str(path), "pinned": pinned})

    def unload_lora_adapter(self, name: str) -> dict[str, Any]:
        """SGLang's ``/unload_lora_adapter``: no new request takes ``name``; it leaves once its requests end."""
        return self.post("/unload_lora_adapter", {"lora_name": name})

    def flush(self) -> None:
        self.post("/flush_cache", {})

    def load(self, version: int) -> None:
        """Activate the prepared ``version`` from the local checkpoint (the engine is paused)."""
        self.post("/update_weights_from_disk", {"model_path": self._need("local_dir"), "weight_version": str(version)})

    def resume(self) -> None:
        self.post("/continue_generation", {})

    def init_weights_update_group(self, body: dict[str, Any]) -> None:
        self.post("/init_weights_update_group", body)

    def update_weights_from_distributed(self, body: dict[str, Any]) -> None:
        self.post("/update_weights_from_distributed", body)

    def begin_weight_update(self) -> None:
        """SGLang >= 0.5.21 loads distributed or tensor updates only inside a weight-update session."""
        self.post("/begin_weight_update", {})

    def end_weight_update(self) -> None:
        self.post("/end_weight_update", {})

    # ------------------------------------------------------------------ colocation

    def release_memory(self, tags: list[str] | None = None) -> None:
        """``/release_memory_occupation`` (SGLang's tags: ``weights``, ``kv_cache``, ``cuda_graph``; None: all)."""
        self.post("/release_memory_occupation", {"tags": tags})

    def resume_memory(self, tags: list[str] | None = None) -> None:
        self.post("/resume_memory_occupation", {"tags": tags})

    def update_weights_from_tensor(self, serialized: list[str], *, weight_version: int | None = None,
                                   flush_cache: bool = False) -> None:
        """Load named tensors shared by reference (one serialized entry per TP rank; see
        :mod:`miles_disagg.engines.tensor_transfer`); ``weight_version`` labels the weights after."""
        body: dict[str, Any] = {"serialized_named_tensors": serialized, "load_format": None,
                                "flush_cache": flush_cache, "abort_all_requests": False}
        if weight_version is not None:
            body["weight_version"] = str(weight_version)
        self.post("/update_weights_from_tensor", body)

    # ------------------------------------------------------------------ state

    def weight_version(self) -> str:
        """The version the engine reports, as it reports it (``/model_info``: SGLang >= 0.5.20 answers
        ``/get_weight_version`` with 404 or not at all)."""
        return str(self.get("/model_info").get("weight_version"))

    def version(self) -> int | None:
        """The served version as a number (None when the engine reports none or a non-number)."""
        from miles_disagg.router.registry import parse_version

        return parse_version(self.get("/model_info").get("weight_version"))

    def healthy(self, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
        try:
            return self.request("GET", "/health", timeout=timeout_s).status_code == 200
        except Exception:  # noqa: BLE001 - any transport failure means "not healthy"
            return False

    # SGLang's current names; the /get_* forms are deprecated there (and kept by the built-in engine)
    def server_info(self) -> dict[str, Any]:
        return self.get("/server_info")

    def model_info(self) -> dict[str, Any]:
        return self.get("/model_info")

    def agent_info(self) -> dict[str, Any] | None:
        """``miles-disagg agent``'s own info; None when the URL is not an agent."""
        try:
            return self.get("/agent_info", timeout_s=PROBE_TIMEOUT_S)
        except (EngineRefused, EngineUnrecoverable):
            return None

    def weight_checksums(self, algorithm: str) -> dict[str, Any]:
        """``/weight_checksums`` (built-in engine: its live weights; agent: the checkpoint it handed
        its engine): ``{"weight_version", "algorithm", "source", "checksums": {name: hex}}``."""
        return self.get(f"/weight_checksums?algorithm={algorithm}", timeout_s=600)

    def announced_delta_filters(self) -> list[str] | None:
        """The delta filters this engine announces it reads (an agent's ``/agent_info``, the built-in
        engine's ``/get_server_info`` ``miles_disagg``); None when it announces none (stock SGLang)."""
        info = self.agent_info()
        if info is None:
            info = (self.server_info().get("miles_disagg") or {})
        filters = info.get("delta_filters") if isinstance(info, dict) else None
        return [str(f) for f in filters] if isinstance(filters, list) else None

    def load_count(self) -> int | None:
        """Requests running or queued in the engine (the built-in engine's server info); None if unknown."""
        try:
            states = self.get("/server_info", timeout_s=LOAD_TIMEOUT_S).get("internal_states") or [{}]
            running, waiting = states[0].get("num_running_requests"), states[0].get("num_waiting_requests")
            return int(running) + int(waiting) if running is not None and waiting is not None else None
        except (MilesDisaggError, ValueError, TypeError, AttributeError):
            return None

    def generate(self, body: dict[str, Any], timeout_s: float | None = None) -> Any:
        """``POST /generate`` (one item or a list, as the engine answers)."""
        return self.call("POST", "/generate", body, timeout_s=timeout_s, whole=True)

    # ------------------------------------------------------------------ transport

    def request(self, method: str, path: str, **kwargs: Any):
        """The raw ``httpx.Response``, with the key ``path`` needs and no other: the admin key only to
        admin paths, the API key (when the run has one) to the others, nothing to open ones. Never
        the admin key in place of a missing API key: an engine leaves its other paths open when it
        has no API key, and an address that is not an engine must not receive the admin key."""
        level = level_of(path.split("?", 1)[0])
        return self._http.request(method, path, headers=self.keys.header_for_level(level, strict=True), **kwargs)

    def get(self, path: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call("GET", path, timeout_s=timeout_s)

    def post(self, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> dict[str, Any]:
        return self.call("POST", path, body if body is not None else {}, timeout_s=timeout_s)

    def call(self, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None,
             whole: bool = False) -> Any:
        """One request; the JSON answer (a dict, or anything when ``whole``) or a typed error."""
        import httpx

        kwargs: dict[str, Any] = {"json": body} if body is not None else {}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        try:
            response = self.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from exc
        payload = response_payload(response)
        if response.status_code == 200 and not (isinstance(payload, dict) and payload.get("success") is False):
            return payload if whole or isinstance(payload, dict) else {"result": payload}
        raise error_for(f"{self.url}{path} answered {response.status_code}: {payload_message(payload)}",
                         response.status_code, path)

    def _need(self, attr: str) -> str:
        value = getattr(self, attr)
        if value is None:
            raise ValueError(f"EngineClient({self.url}) was made without {attr}")
        return value


def error_for(message: str, status: int, path: str) -> MilesDisaggError:
    if status in (400, 401, 403, 404, 413, 422):
        return StagingRefused(message) if path == "/pull_weights" else EngineRefused(message)
    if status == 409:
        return EngineBusy(message)
    return EngineUnrecoverable(message)
