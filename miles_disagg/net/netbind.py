"""Where a run's servers listen, the keys it hands them, and how its Ray cluster is protected.

* :func:`bind_host` is the one decision of the bind address: every engine, agent and router a
  run starts binds ``127.0.0.1`` while the job runs on one node, and the node's IP only when it
  spans nodes (:func:`job_spans_nodes`), always with keys. :data:`NODE_IP` is resolved on the
  node where the server starts (:func:`resolve_host`), since only that node knows its address.
* :func:`run_keys` gives a run its keys: the job flags (``--rollout-api-key``,
  ``--rollout-admin-api-key``) or the environment, and a fresh random admin key when none is
  given. :func:`export_keys` puts them in this process's environment, from which every
  process the run starts inherits them (and :func:`keys_runtime_env` hands them to Ray actors).
* :func:`inherit_into_local_ray`: a local Ray this process starts inherits its environment (the
  keys, one OpenMP thread per worker), so its actors need no ``runtime_env``: a worker with one
  starts through Ray's setup process, which costs each actor about half a CPU-second more.
* :func:`keep_ray_token_auth`: a Ray cluster this project starts keeps Ray's token
  authentication on (tests may set ``RAY_AUTH_MODE=disabled`` for their own cluster).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Iterable

from miles_disagg.net.auth import ApiKeys, new_key

LOOPBACK = "127.0.0.1"
NODE_IP = "node-ip"
RAY_AUTH_MODE_ENV = "RAY_AUTH_MODE"
RAY_TOKEN_ENVS = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
RAY_DEFAULT_TOKEN_FILE = Path("~/.ray/auth_token")


def bind_host(*, spans_nodes: bool) -> str:
    """Loopback for a one-node job, else :data:`NODE_IP` (resolved where the server starts)."""
    return NODE_IP if spans_nodes else LOOPBACK


def resolve_host(host: str) -> str:
    """:data:`NODE_IP` -> this node's IP (as Ray sees it); any other address as it is."""
    if host != NODE_IP:
        return host
    import ray

    return ray.util.get_node_ip_address()


def job_spans_nodes(placement_node_ids: Iterable[str]) -> bool:
    """Whether a run's processes may sit on more than one node: its placement bundles do, or the
    Ray cluster has more than one live node (actors outside the placement, like the rollout
    manager, may be scheduled on any of them)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    return len(set(placement_node_ids)) > 1 or len(alive) > 1


def run_keys(api_key: str | None, admin_api_key: str | None) -> ApiKeys:
    """The run's keys: the job flags, else the environment; a random admin key when neither gives one."""
    keys = ApiKeys.resolve(api_key, admin_api_key)
    return keys if keys.admin_api_key else ApiKeys(keys.api_key, new_key())


def export_keys(keys: ApiKeys) -> None:
    """Into this process's environment: children started from here inherit them."""
    os.environ.update(keys.env())


LOCAL_RAY_ENV = "MILES_DISAGG_LOCAL_RAY"  # "1" in every process of a local Ray this project started
WORKER_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # what every Ray worker of a run gets


# A local Ray starts no idle workers for its first driver: a run's tasks and actors ask for GPU
# bundles or a runtime_env those workers cannot serve (each idle worker costs half a CPU-second).
# Its workers run at the niceness of the process that started it: Ray's default (nice 15, to keep
# its own processes responsive) would give the run's real work - the trainer ranks, the engines
# they start, the managers - to any other process on the machine (with two busy processes on two
# cores, a run's engines got a few percent of a core and its steps took a minute and more).
LOCAL_RAY_SYSTEM_CONFIG = {"prestart_worker_first_driver": False, "worker_niceness": 0}


def inherit_into_local_ray() -> None:
    """Before starting a local Ray: its raylet, and so every worker, inherits this environment,
    with :data:`WORKER_ENV` and the :data:`LOCAL_RAY_ENV` marker set."""
    os.environ.update({**WORKER_ENV, LOCAL_RAY_ENV: "1"})


def on_local_ray() -> bool:
    """Whether this process belongs to a local Ray this project started (its workers inherited
    the starting process's environment: keys and :data:`WORKER_ENV`)."""
    return os.environ.get(LOCAL_RAY_ENV) == "1"


def worker_runtime_env(env_vars: dict[str, str]) -> dict | None:
    """The ``runtime_env`` that gives an actor ``env_vars``: None on a local Ray whose workers
    already inherit them, or when there are none."""
    inherited = on_local_ray() and all(os.environ.get(k) == v for k, v in env_vars.items())
    return None if inherited or not env_vars else {"env_vars": dict(env_vars)}


def keys_runtime_env() -> dict | None:
    """A Ray ``runtime_env`` that hands this process's keys to an actor (None: there are none, or
    the actor inherits them on a local Ray)."""
    return worker_runtime_env(ApiKeys.from_env().env())


RAY_TOKEN_NOTICE = "Token authentication is enabled for this Ray cluster"
RAY_TOKEN_LOGGER = "ray._private.authentication.authentication_token_setup"


class _DropRayTokenNotice(logging.Filter):
    """Drops Ray's notice that token authentication is on by default (printed on every local start;
    docs/security.md, "Where things bind", says once what the default is and how to set a token).
    Every other record passes, the warning that authentication is *disabled* included."""

    def filter(self, record: logging.LogRecord) -> bool:
        return RAY_TOKEN_NOTICE not in record.getMessage()


def quiet_ray_token_notice() -> None:
    """Install :class:`_DropRayTokenNotice` on Ray's authentication logger (once per process)."""
    logger = logging.getLogger(RAY_TOKEN_LOGGER)
    if not any(isinstance(f, _DropRayTokenNotice) for f in logger.filters):
        logger.addFilter(_DropRayTokenNotice())


def keep_ray_token_auth(ray_imported: bool | None = None) -> None:
    """Before starting a local Ray: token authentication stays on unless the caller chose a mode.
    Ray (>= 2.60) turns it on by itself when the mode is unset, using the token it finds or one it
    writes (``~/.ray/auth_token``), and refuses to start in token mode without a token. Ray reads
    the mode when it is imported: set afterwards, this process would send no token to the cluster
    it starts, which wants one. So the mode is set to ``token`` only where a token exists
    (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``) and Ray is not imported
    yet (``ray_imported``: None looks at ``sys.modules``); otherwise Ray's default stands."""
    quiet_ray_token_notice()
    if os.environ.get(RAY_AUTH_MODE_ENV):
        return
    if ray_imported is None:
        ray_imported = "ray" in sys.modules
    if ray_imported:
        return
    if any(os.environ.get(name) for name in RAY_TOKEN_ENVS) or RAY_DEFAULT_TOKEN_FILE.expanduser().exists():
        os.environ[RAY_AUTH_MODE_ENV] = "token"
