"""What an engine the run did not start must show before the run uses it, and what it says of itself.

An attached engine (``--rollout-external-engine-addrs`` at start, ``engines add`` mid-run, or one
that answers again after it stopped) must answer ``/health`` and match the job: architecture, tp
size, context length and dtype, and (disk-delta) pull from this job's version store, all shown
before any key is sent to it (:mod:`miles_disagg.fleet.vetting`). Every check here reads the
engine over HTTP; none changes it. Engines attached at start are then brought to the job's base
(:func:`bring_to_base`).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.engines.client import EngineClient
from miles_disagg.fleet.slots import EngineSlots
from miles_disagg.fleet.vetting import Vetting, check_engine_url, vet
from miles_disagg.types import ConfigError, InvalidInput

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 120.0
"""How long an engine named at start has to answer ``/health``."""


def attached_engines(config: EngineManagerConfig) -> list[Vetting]:
    """The engines named by ``--rollout-external-engine-addrs``, each answering and matching the job
    (:func:`~miles_disagg.fleet.vetting.vet`: no key is sent before it passed) and each a server of
    its own; else ``ConfigError`` naming the first that is not."""
    flag = "--rollout-external-engine-addrs"
    passed: list[Vetting] = []
    for addr in config.rollout.rollout_external_engine_addrs:
        try:
            vetting = vet(config, check_engine_url(f"http://{addr}"), answer_timeout_s=ATTACH_TIMEOUT_S)
        except InvalidInput as exc:
            raise ConfigError(f"{flag}: {exc}", (flag,)) from None
        if not vetting.answered:
            raise ConfigError(f"{flag}: {vetting.url} did not answer /health: {vetting.not_answering}", (flag,))
        if vetting.refusal is not None:
            raise ConfigError(f"{flag} {addr} {vetting.refusal}", (flag,))
        same = next((p for p in passed if p.server_ids & vetting.server_ids), None)
        if same is not None:
            raise ConfigError(f"{flag}: {addr} is {same.url.removeprefix('http://')} under another address (the same "
                              "server answers both); name each engine once", (flag,))
        passed.append(vetting)
    return passed


def bring_to_base(config: EngineManagerConfig, slots: EngineSlots, updater: Callable) -> None:
    """Attached engines may still serve an earlier job's version: bring each to this job's base
    (version 0) before the router sees it (``updater(indices, registered=False)``: the engine
    manager's). Broadcast mode cannot (no store): ``ConfigError``, exit 2."""
    stale = {}
    for index, url in enumerate(slots.urls()):
        with EngineClient(url, timeout_s=10) as client:
            reported = client.weight_version()
        if reported != "0":
            stale[index] = reported
    if not stale:
        return
    described = ", ".join(f"{slots.url(i).removeprefix('http://')} serves weight version {v!r}"
                          for i, v in stale.items())
    if config.weights.update_weight_transfer_mode != "disk-delta":
        raise ConfigError(f"--rollout-external-engine-addrs: {described}, not this job's base (version 0), "
                          "and broadcast mode cannot reset an engine; restart it on --hf-checkpoint or use "
                          "--update-weight-transfer-mode disk-delta", ("--rollout-external-engine-addrs",))
    log.warning("%s: bringing them to this job's base (version 0)", described)
    update = updater(list(stale), registered=False)
    try:
        update.update(0)
    finally:
        update.close()
    slots.record({"event": "reset_to_base", "engines": list(stale), "time": time.time()})


def engine_local_dir(url: str, default: Path) -> str:
    """The engine host's own local checkpoint (an agent's, or a built-in engine's
    ``--local-checkpoint-dir``), else ``default``: a server writes only the one it was started with."""
    with EngineClient(url, timeout_s=5) as client:
        info = client.agent_info() or client.server_info()
    said = info.get("local_checkpoint_dir")
    return said if isinstance(said, str) and os.path.isabs(said) else str(default)


def announced_filters(url: str) -> list[str] | None:
    """The delta formats the engine at ``url`` says it reads (None: it does not say)."""
    with EngineClient(url, timeout_s=10) as client:
        return client.announced_delta_filters()
