"""What an engine the run did not start must show before the run uses it, and what it says of itself.

An attached engine (``--rollout-external-engine-addrs`` at start, ``engines add`` mid-run, or one
that answers again after it stopped) must answer ``/health`` and match the job: architecture, tp
size, context length and dtype, and (disk-delta) pull from this job's version store. Every check
here reads the engine over HTTP; none changes it. Engines attached at start are then brought to
the job's base (:func:`bring_to_base`).
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
from miles_disagg.types import ConfigError

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 120.0
"""How long an engine named at start has to answer ``/health``."""


def wait_answering(url: str, timeout_s: float) -> None:
    """Until the engine at ``url`` answers ``/health``; ``ConfigError`` naming
    ``--rollout-external-engine-addrs`` when it does not within ``timeout_s``."""
    from miles_disagg.net.process import NotHealthy, wait_healthy

    try:
        wait_healthy(url, timeout_s=timeout_s, poll_s=1.0)
    except NotHealthy as exc:
        raise ConfigError(f"--rollout-external-engine-addrs: {url} did not answer /health: {exc.reason}",
                          ("--rollout-external-engine-addrs",)) from None


def attached_urls(config: EngineManagerConfig) -> list[str]:
    """The engines named by ``--rollout-external-engine-addrs``, each answering and matching the job;
    else ``ConfigError`` naming the first that does not."""
    urls = [f"http://{addr}" for addr in config.rollout.rollout_external_engine_addrs]
    for url in urls:
        wait_answering(url, ATTACH_TIMEOUT_S)
        problems = mismatches(config, url)
        if problems:
            raise ConfigError(f"--rollout-external-engine-addrs {url.removeprefix('http://')} does not match this "
                              f"job: {'; '.join(problems)}", ("--rollout-external-engine-addrs",))
    return urls


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


def mismatches(config: EngineManagerConfig, url: str) -> list[str]:
    """Why the engine at ``url`` cannot serve this job (architecture, tp size, context, dtype, store);
    empty when it can."""
    from miles_disagg.engines.check import EngineExpectation, check_engine_matches

    expected = EngineExpectation.from_hf_checkpoint(config.model_path, config.cluster.rollout_num_gpus_per_engine,
                                                    config.rollout.engine_dtype)
    with EngineClient(url, timeout_s=10) as client:
        server_info = client.server_info()
        return check_engine_matches(expected, server_info, client.model_info()) + _store_mismatch(config, server_info)


def _store_mismatch(config: EngineManagerConfig, server_info: dict) -> list[str]:
    """Disk-delta: a built-in engine pulls only from its ``--weight-store-dir``s (an agent says
    nothing here and refuses a wrong store at the first pull, naming its roots)."""
    weights = config.weights
    stores = server_info.get("weight_store_dirs")
    ours = weights.update_weight_disk_dir
    if weights.update_weight_transfer_mode != "disk-delta" or stores is None or not ours:
        return []
    if any(os.path.realpath(s) == os.path.realpath(ours) for s in stores):
        return []
    return [f"weight store: the engine pulls only from {stores or 'no store (no --weight-store-dir)'}, "
            f"this job publishes to {ours!r}; start it with --weight-store-dir {ours}"]


def engine_local_dir(url: str, default: Path) -> str:
    """The engine host's own local checkpoint (an agent's, or a built-in engine's
    ``--local-checkpoint-dir``), else ``default``: a server writes only the one it was started with."""
    with EngineClient(url, timeout_s=5) as client:
        info = client.agent_info() or client.server_info()
    return str(info.get("local_checkpoint_dir") or default)


def announced_filters(url: str) -> list[str] | None:
    """The delta formats the engine at ``url`` says it reads (None: it does not say)."""
    with EngineClient(url, timeout_s=10) as client:
        return client.announced_delta_filters()
