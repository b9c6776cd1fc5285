"""What an address must show before the run sends it any key, and which server it is.

An address someone names (``--rollout-external-engine-addrs``, ``engines add``, an attached engine
that answers again) is an unknown server until it has shown, without any ``Authorization``
header, that it is an engine of this job:

1. ``GET /health`` answers 200 (an engine still loading may answer 503 first: it is asked again
   until the wait runs out). The answer's :data:`~miles_disagg.net.asgi_guard.SERVER_ID_HEADER`
   values are the server's identity: the built-in engine and the agent send one, random per
   process (through an agent: the agent's and its engine's). Stock SGLang sends none; its
   ``/server_info`` ``startup_time`` and ``port`` stand in for it.
2. ``GET /server_info`` and ``/model_info`` (and ``/agent_info``, where the address is an agent)
   answer JSON objects, asked without a key. An address that answers ``/server_info`` with 401
   wants a key before it has shown anything: it is refused (:data:`WANTS_KEY`), unless the run was
   started with ``--rollout-api-key-before-vetting``, which sends the run's API key (never the admin
   key) for these reads. The admin key goes only to an engine that passed, with the first
   weight-update call.
3. :func:`~miles_disagg.engines.check.check_engine_matches` finds nothing (every compared field
   present, well typed and equal) and, for disk-delta, the engine names this job's version store
   among those it pulls from (``weight_store_dirs``: an agent's ``/agent_info``, else the built-in
   engine's ``/server_info``; absent means refused); a run serving LoRA adapter versions needs an
   engine that serves them from its adapter chain (``enable_lora``, ``lora_base_dir``), never one
   that would serve the bare base.

A URL carrying ``user:password@`` is refused before anything is sent (an HTTP client would send
them), and so is one longer than :data:`MAX_ENGINE_ADDRESS_CHARS` (or a host name longer than DNS allows).
Nothing here raises for what an address answered: :class:`Vetting` says why it is refused.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.validate import MAX_ENGINE_ADDRESS_CHARS
from miles_disagg.engines.roots import same_store
from miles_disagg.net.asgi_guard import SERVER_ID_HEADER
from miles_disagg.net.auth import ApiKeys, AuthLevel
from miles_disagg.types import InvalidInput

PROBE_TIMEOUT_S = 2.0
"""One ``/health`` probe."""
INFO_TIMEOUT_S = 10.0
"""One info read (``/server_info``, ``/model_info``, ``/agent_info``)."""
MAX_ANSWER_BYTES = 4 << 20
"""An info answer longer than this is not read (an engine's is a few kB)."""
MAX_HOSTNAME_CHARS = 253
"""The longest host name DNS allows."""
KEY_BEFORE_VETTING_FLAG = "--rollout-api-key-before-vetting"
WANTS_KEY = ("answers /server_info with 401: it wants a key before it has shown it is an engine of this job, and the "
             "run sends a key only to an address that has (start it with its info endpoints open, or pass "
             f"{KEY_BEFORE_VETTING_FLAG} to send the run's API key for these checks); nothing was sent to it with a key")
"""The refusal of an address whose info endpoints answer 401 to a request without a key."""


@dataclass(frozen=True)
class Vetting:
    """What one address showed. ``refusal``: why it cannot be used (None: it passed)."""

    url: str
    server_ids: frozenset[str] = frozenset()
    """Who answered (see the module docstring); empty when it did not answer."""
    refusal: str | None = None
    """A phrase to follow the address: ``does not answer /health (...)``, ``cannot read its server
    and model info (...)`` or ``does not match this job: ...``."""
    not_answering: str | None = None
    """Set when ``/health`` never answered 200: the last thing it answered (or why not)."""
    problems: tuple[str, ...] = field(default=())
    """The mismatches, one per field (empty unless the refusal is a mismatch)."""
    info: dict = field(default_factory=dict)
    """``server_info``, ``model_info`` and ``agent_info`` (None: not an agent) as read."""

    @property
    def answered(self) -> bool:
        return self.not_answering is None


def check_engine_url(url: str) -> str:
    """``url`` when an engine may be reached there: ``http(s)://host:port`` and nothing else.
    ``InvalidInput`` naming what is wrong: credentials (``user:pass@``), another scheme, a path,
    query or fragment, no host, no or a bad port, too long."""
    shown = url if len(url) <= 100 else url[:97] + "..."
    if len(url) > MAX_ENGINE_ADDRESS_CHARS:
        raise InvalidInput(f"engine address too long: {len(url)} characters, at most {MAX_ENGINE_ADDRESS_CHARS} ({shown!r})")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise InvalidInput(f"not an engine address: {shown!r} ({exc})") from None
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise InvalidInput(f"not an engine address: {parts.scheme}://...@{parts.hostname}: an engine address carries "
                           "no user or password (give host:port; the run's keys authenticate)")
    if parts.scheme not in ("http", "https"):
        raise InvalidInput(f"not an engine address: {shown!r} (http://host:port or https://host:port)")
    if not parts.hostname or port is None:
        raise InvalidInput(f"not an engine address: {shown!r} (give host:port)")
    if len(parts.hostname) > MAX_HOSTNAME_CHARS:
        raise InvalidInput(f"engine address too long: its host name has {len(parts.hostname)} characters, at most "
                           f"{MAX_HOSTNAME_CHARS} ({shown!r})")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise InvalidInput(f"not an engine address: {shown!r} (host:port only, no path or query)")
    return url


class NotAnswering(InvalidInput):
    """``/health`` did not answer 200 within the wait; ``reason`` names the last answer."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(reason)


def health_identity(url: str, timeout_s: float, poll_s: float = 1.0) -> frozenset[str]:
    """Until ``GET url/health`` (no key) answers 200: the server ids it answered with.
    :class:`NotAnswering` after ``timeout_s`` (0: one try)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with httpx.Client(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
        while True:
            try:
                response = client.get(f"{url}/health")
                if response.status_code == 200:
                    return frozenset(v.strip() for value in response.headers.get_list(SERVER_ID_HEADER)
                                     for v in value.split(",") if v.strip())
                last = f"/health answered {response.status_code}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if time.monotonic() + poll_s > deadline:
                raise NotAnswering(f"not healthy after {timeout_s:g}s ({last})")
            time.sleep(poll_s)


class Unreadable(InvalidInput):
    """An info endpoint did not answer a JSON object (named in the message)."""


class WantsKey(Unreadable):
    """``/server_info`` answered 401 without a key, and no key may be sent before vetting (:data:`WANTS_KEY`)."""


def read_info(url: str, keys: ApiKeys | None = None, *, api_key_before_vetting: bool = False) -> dict[str, Any]:
    """``{"server_info", "model_info", "agent_info"}`` of the engine at ``url``, read without a key.
    A 401 there is :class:`WantsKey`, unless ``api_key_before_vetting`` (``--rollout-api-key-before-vetting``):
    then it is asked again with the API key of ``keys`` (None: the environment's), never the admin key.
    ``agent_info`` is None where the address is not an agent. :class:`Unreadable` naming the
    endpoint and what it answered otherwise."""
    import httpx

    keys = keys if keys is not None else ApiKeys.from_env()
    with httpx.Client(base_url=url, timeout=INFO_TIMEOUT_S, trust_env=False) as client:
        headers: dict[str, str] = {}
        status, body = _get(client, "/server_info", headers)
        if status == 401 and not api_key_before_vetting:
            raise WantsKey(WANTS_KEY)
        if status == 401 and keys.api_key:
            headers = ApiKeys(api_key=keys.api_key).header_for_level(AuthLevel.NORMAL)
            status, body = _get(client, "/server_info", headers)
        server_info = _json_object(status, body, "/server_info")
        model_info = _json_object(*_get(client, "/model_info", headers), "/model_info")
        status, body = _get(client, "/agent_info", headers)
        agent_info = _json_object(status, body, "/agent_info") if status == 200 else None
    return {"server_info": server_info, "model_info": model_info, "agent_info": agent_info}


def _get(client, path: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """(status, body) of one GET; a body over :data:`MAX_ANSWER_BYTES` is not read whole."""
    import httpx

    try:
        with client.stream("GET", path, headers=headers) as response:
            body = bytearray()
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise Unreadable(f"{path} answered more than {MAX_ANSWER_BYTES} bytes")
            return response.status_code, bytes(body)
    except httpx.HTTPError as exc:
        raise Unreadable(f"{path}: {type(exc).__name__}: {exc}" if str(exc) else f"{path}: {type(exc).__name__}") from None


def _json_object(status: int, body: bytes, path: str) -> dict:
    if status != 200:
        raise Unreadable(f"{path} answered {status}")
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        raise Unreadable(f"{path} answered something that is not JSON") from None
    if not isinstance(value, dict):
        kind = "a list" if isinstance(value, list) else type(value).__name__
        raise Unreadable(f"{path} answered {kind}, not a JSON object")
    return value


def sglang_identity(server_info: dict) -> frozenset[str]:
    """Stock SGLang's stand-in identity (no server-id header): its start time and port."""
    started, port = server_info.get("startup_time"), server_info.get("port")
    if isinstance(started, (int, float)) and not isinstance(started, bool) and isinstance(port, int):
        return frozenset({f"sglang:{port}:{started!r}"})
    return frozenset()


def store_problems(config: EngineManagerConfig, server_info: dict, agent_info: dict | None) -> list[str]:
    """Disk-delta: the engine must name this job's store among those it pulls from (an agent in
    its ``/agent_info``, the built-in engine in its ``/server_info``); absent is a problem."""
    weights = config.weights
    ours = weights.update_weight_disk_dir
    if weights.update_weight_transfer_mode != "disk-delta" or not ours:
        return []
    where, source = ("/agent_info", agent_info) if agent_info is not None else ("/server_info", server_info)
    stores = source.get("weight_store_dirs")
    if stores is None:
        return [f"weight store: the engine does not say which version stores it pulls from (no weight_store_dirs "
                f"in {where}); this job publishes to {ours!r}: start it with --weight-store-dir {ours}"]
    if not isinstance(stores, list) or not all(isinstance(s, str) for s in stores):
        return [f"weight store: {where} weight_store_dirs is not a list of paths"]
    if any(_names_store(s, ours) for s in stores):
        return []
    return [f"weight store: the engine pulls only from {stores or 'no store (no --weight-store-dir)'}, "
            f"this job publishes to {ours!r}; start it with --weight-store-dir {ours}"]


def lora_problems(config: EngineManagerConfig, server_info: dict, agent_info: dict | None) -> list[str]:
    """A run serving LoRA adapter versions: the engine must serve them (``enable_lora``) from this
    run's adapter chain (``lora_base_dir``: the built-in engine's ``/server_info``, an agent's
    ``/agent_info``, or ``lora_base_from_store`` where the chain's version 0 is in the run's object
    store); one that would serve the bare base is a problem."""
    ours = config.lora_base_dir
    if not ours:
        return []
    given = "--lora-base-from-store" if config.lora_base_from_store else f"--lora-base-dir {ours}"
    source = agent_info if agent_info is not None else server_info
    if agent_info is not None:
        start = f"start the agent with {given} in front of SGLang started with --enable-lora"
        where, theirs = "the agent's", agent_info.get("lora_base_dir")
    else:
        start = f"start a built-in engine with --enable-lora {given}"
        where, theirs = "the engine's", server_info.get("lora_base_dir")
    if server_info.get("enable_lora") is not True:
        return [f"LoRA adapter versions: the engine was started without --enable-lora and would serve the bare base; "
                f"{start}"]
    if config.lora_base_from_store:  # the chain's version 0 is the store's (which store: store_problems)
        if source.get("lora_base_from_store") is True:
            return []
        return [f"LoRA adapter versions: {where} adapter chain starts at {theirs!r} (--lora-base-dir), this run's "
                f"is in its object store {config.weights.update_weight_disk_dir}; {start}"]
    return chain_mismatch(where, theirs, ours, start)


def service_lora_problems(lora_base_dir: str | None, service_info: dict) -> list[str]:
    """The rollout service (its gateway's ``/service_info``) must serve what the run publishes: a run
    serving LoRA adapter versions from ``lora_base_dir`` needs a service of that adapter chain, never
    one that would serve the bare base; a full-weight run (None) needs a full-weight service."""
    serves, theirs = service_info.get("serves"), service_info.get("lora_base_dir")
    start = f"start it with `miles-disagg serve local|ray --lora-base-dir {lora_base_dir}`"
    if lora_base_dir is None:
        if serves == "lora_adapter_versions":
            return [f"the service serves LoRA adapter versions from {theirs!r} and this run publishes full-weight "
                    "versions; start it without --lora-base-dir"]
        return []
    if serves != "lora_adapter_versions":
        return [f"LoRA adapter versions: the service serves full-weight versions (started without --lora-base-dir) "
                f"and would serve the bare base; {start}"]
    return chain_mismatch("the service's", theirs, lora_base_dir, start)


def chain_mismatch(where: str, theirs, ours: str, start: str) -> list[str]:
    """The one-line problem when an adapter chain announced as ``theirs`` is not this run's ``ours``
    (``where``: whose announcement; ``start``: how to start one that serves it)."""
    if isinstance(theirs, str) and os.path.realpath(theirs) == os.path.realpath(ours):
        return []
    return [f"LoRA adapter versions: {where} adapter chain starts at {theirs!r} (--lora-base-dir), this run's at "
            f"{ours!r}, so it would not serve this run's adapters; {start}"]


def vet(config: EngineManagerConfig, url: str, *, answer_timeout_s: float) -> Vetting:
    """Everything the module docstring lists, in that order; stops at the first step that fails.
    ``InvalidInput`` (nothing sent) for a URL :func:`check_engine_url` refuses."""
    from miles_disagg.engines.check import EngineExpectation, check_engine_matches

    check_engine_url(url)  # the callers' own check: credentials in a URL are never sent anywhere
    try:
        server_ids = health_identity(url, answer_timeout_s)
    except NotAnswering as exc:
        return Vetting(url, refusal=f"does not answer /health (engine unreachable: {exc.reason})",
                       not_answering=exc.reason)
    try:
        info = read_info(url, api_key_before_vetting=config.rollout.rollout_api_key_before_vetting)
    except WantsKey as exc:
        return Vetting(url, server_ids, refusal=str(exc))
    except Unreadable as exc:
        return Vetting(url, server_ids, refusal=f"cannot read its server and model info ({exc})")
    expected = EngineExpectation.from_hf_checkpoint(config.model_path, config.cluster.rollout_num_gpus_per_engine,
                                                    config.rollout.engine_dtype)
    problems = (check_engine_matches(expected, info["server_info"], info["model_info"])
                + store_problems(config, info["server_info"], info["agent_info"])
                + lora_problems(config, info["server_info"], info["agent_info"]))
    server_ids = server_ids or sglang_identity(info["server_info"])
    refusal = f"does not match this job: {'; '.join(problems)}" if problems else None
    return Vetting(url, server_ids, refusal, problems=tuple(problems), info=info)


def _names_store(theirs: str, ours: str) -> bool:
    try:
        return same_store(theirs, ours)
    except InvalidInput:  # an engine listing a malformed URL does not name ours
        return False
