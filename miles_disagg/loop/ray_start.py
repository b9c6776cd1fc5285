"""Where a run's Ray comes from: the cluster at ``RAY_ADDRESS``, or a local Ray this process starts
(with logical GPUs on a machine without CUDA). Local starts on one machine take turns (a file lock):
two starts at once starve each other past Ray's fixed wait for its node on a small machine, and a
start that timed out is stopped and tried again (:data:`LOCAL_RAY_START_ATTEMPTS` in all)."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from miles_disagg.loop.waiting import still
from miles_disagg.tracking import status
from miles_disagg.types import ConfigError

T = TypeVar("T")
RAY_TMPDIR_ENV = "MILES_DISAGG_RAY_TMPDIR"
"""A directory for a local Ray's sockets and logs (short: Ray's socket paths must be)."""


def init_ray(num_bundles: int) -> bool:
    """Connect to ``RAY_ADDRESS`` if set, else start a local Ray; on a machine without CUDA
    the local Ray gets ``num_bundles`` logical GPUs. Returns whether this process started it."""
    import ray

    if ray.is_initialized():
        return False
    from miles_disagg.loop.interrupts import reclaim_sigterm
    from miles_disagg.net.netbind import LOCAL_RAY_SYSTEM_CONFIG, inherit_into_local_ray, keep_ray_token_auth

    if os.environ.get("RAY_ADDRESS"):  # an existing cluster (also how a `ray job submit` driver connects)
        # no runtime_env here: a submitted job's own (its working_dir) must stay; the actor handles
        # hand the keys to their actors themselves (netbind.keys_runtime_env)
        status(f"connecting to the Ray cluster at {os.environ['RAY_ADDRESS']}")
        ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
        reclaim_sigterm()
        _report_cluster()
        _check_cluster_offers(num_bundles)
        return True
    cuda_devices = cuda_device_count()
    num_gpus = cuda_devices or num_bundles  # without CUDA: logical GPUs, one per bundle
    tmp = os.environ.get(RAY_TMPDIR_ENV)
    keep_ray_token_auth()  # Ray's own token auth stays on (tests may set RAY_AUTH_MODE=disabled)
    # every actor of the run enforces and sends the run's keys: its workers inherit them (and one
    # OpenMP thread each) from this environment, with no runtime_env to set up per worker
    inherit_into_local_ray()
    status(f"starting a local Ray ({num_gpus} {'GPUs' if cuda_devices else 'logical GPUs'})")
    with still("starting the local Ray"):
        _start_local_ray(num_cpus=local_ray_num_cpus(), num_gpus=num_gpus, include_dashboard=False,
                         logging_level="WARNING", _temp_dir=str(Path(tmp).resolve()) if tmp else None,
                         _system_config=LOCAL_RAY_SYSTEM_CONFIG)
    reclaim_sigterm()
    return True


LOCAL_RAY_START_ATTEMPTS = 3
"""Tries of a local Ray start whose node timed out: the raylet registers only once Ray's Python agents
are up, within a fixed 30 s, and on a machine whose cores other processes keep busy an agent's start
can take longer (2026-12-04, two busy loops beside the test suite: one run's start timed out twice)."""
START_TURN_WAIT_S = 300.0
_start_turn = threading.local()


@contextlib.contextmanager
def local_ray_start_turn(wait_s: float = START_TURN_WAIT_S) -> Iterator[bool]:
    """One local Ray start at a time on this machine (every run and test of this user): a start is
    a burst of processes importing Ray's agents, and two bursts on a small machine starve each
    other past Ray's fixed 30 s wait for its node. Yields whether the turn was had: after
    ``wait_s`` the start goes anyway. An ``flock`` (a process that dies frees it), re-entrant
    within a thread."""
    import fcntl
    import tempfile
    import time

    if getattr(_start_turn, "held", False):
        yield True
        return
    fd = os.open(Path(tempfile.gettempdir()) / f"miles-disagg-ray-start-{os.getuid()}.lock", os.O_RDWR | os.O_CREAT,
                 0o600)
    deadline, held = time.monotonic() + wait_s, False
    try:
        while not held and time.monotonic() < deadline:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
            except OSError:
                time.sleep(0.2)
        _start_turn.held = held
        yield held
    finally:
        _start_turn.held = False
        os.close(fd)  # releases the flock


def _start_local_ray(**options) -> None:
    """``ray.init(**options)`` in start turns, tried again when the node did not come up in time
    (:func:`start_with_retries`). On a loaded machine Ray's node agents can start slower than the
    raylet waits for them (a fixed timeout, after which it exits and ``ray.init`` raises a bare
    ``Exception``)."""
    import ray

    start_with_retries(lambda: ray.init(**options), stop_ray_children, "the local Ray")


def start_with_retries(start: Callable[[], T], clean_up: Callable[[], None], what: str,
                       turn_wait_s: float = START_TURN_WAIT_S) -> T:
    """``start()`` in a start turn (:func:`local_ray_start_turn`); when it fails because the node
    timed out during startup, ``clean_up()`` (stop what the failed start left) and again,
    :data:`LOCAL_RAY_START_ATTEMPTS` tries in all. Any other failure, or the last try's timeout, is
    raised."""
    for attempt in range(1, LOCAL_RAY_START_ATTEMPTS + 1):
        try:
            with local_ray_start_turn(turn_wait_s):
                return start()
        except Exception as exc:  # ray.init raises a bare Exception; `ray start` fails as the caller raises
            if "timed out during startup" not in str(exc) or attempt == LOCAL_RAY_START_ATTEMPTS:
                raise
            status(f"{what} did not come up in time ({str(exc).splitlines()[0]}); starting it again "
                   f"(try {attempt + 1} of {LOCAL_RAY_START_ATTEMPTS})")
            clean_up()
    raise AssertionError("unreachable")


def stop_ray_children(timeout_s: float = 10.0) -> None:
    """Terminate (then kill) this process's descendants that run Ray's own programs (what a failed
    local Ray start left: the GCS, the raylet, its agents)."""
    import psutil

    marker = f"{os.sep}ray{os.sep}"
    ours = []
    for child in psutil.Process().children(recursive=True):
        try:
            if marker in " ".join(child.cmdline()):
                ours.append(child)
        except psutil.Error:
            continue
    for child in ours:
        with contextlib.suppress(psutil.Error):
            child.terminate()
    _, alive = psutil.wait_procs(ours, timeout=timeout_s)
    for child in alive:
        with contextlib.suppress(psutil.Error):
            child.kill()


def _report_cluster() -> None:
    import ray

    nodes = [n for n in ray.nodes() if n["Alive"]]
    totals = ray.cluster_resources()
    custom = {k: v for k, v in totals.items()
              if k not in ("CPU", "GPU", "memory", "object_store_memory") and not k.startswith("node:")}
    status(f"joined the Ray cluster at {os.environ['RAY_ADDRESS']}: {len(nodes)} node(s), "
           f"{totals.get('GPU', 0):g} GPUs" + (f", resources {custom}" if custom else ""))


def local_ray_num_cpus() -> int:
    """The CPUs a local Ray started by a run offers (every bundle takes one)."""
    return max(8, os.cpu_count() or 1)


def _check_cluster_offers(num_bundles: int) -> None:
    """A cluster must hold the GPU and CPU bundles asked for (1 GPU + 1 CPU each) before the run
    waits for them: ``ConfigError`` naming what it has. (Busy GPUs are waited for, with progress.)"""
    import ray

    totals = ray.cluster_resources()
    gpus, cpus = totals.get("GPU", 0), totals.get("CPU", 0)
    if gpus < num_bundles or cpus < num_bundles:
        raise ConfigError(f"the Ray cluster at {os.environ['RAY_ADDRESS']} has {gpus:g} GPUs and {cpus:g} CPUs; "
                          f"this run asks for {num_bundles} bundles of 1 GPU + 1 CPU",
                          ("--actor-num-nodes", "--actor-num-gpus-per-node", "--rollout-num-gpus"))


def cuda_device_count() -> int:
    """The CUDA devices this process sees. torch (about two CPU-seconds to import, which the
    driver otherwise never needs) is imported only where an NVIDIA driver is installed."""
    if not os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi") is None:
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
