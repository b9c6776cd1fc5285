"""A Ray cluster of several raylets on this one machine, started with ``ray start`` as a user would.

Each node is started in a start turn (at most so many Ray starts at once on the machine), and a
start that timed out is stopped and made once more (``tests/ray_start.py``). Each node has its
own temp dir and its own ports (the dashboard agent, runtime-env agent and
metrics ports default to fixed numbers that two raylets on one machine cannot share). A worker
node may run in a private mount namespace with a tmpfs over some directories, so that what it
writes there is invisible to the other nodes (and what the others wrote there is invisible to
it): a "local disk" of its own. Everything is stopped by process id: the ``ray start`` process
groups, then any process left that carries this cluster's marker in its environment.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from deadlines import scaled
from ray_start import start_retrying

from miles_disagg.net.process import free_port

RAY = str(Path(sys.executable).with_name("ray"))
MARKER_ENV = "MILES_DISAGG_TEST_CLUSTER"
OUR_ACTORS = ("ray::TrainerRank", "ray::EngineManager", "ray::EngineProcess", "ray::RolloutManager")
"""The actors a run places on the cluster (as their worker processes name themselves)."""
START_TIMEOUT_S = scaled(240.0)


@dataclass
class RayNode:
    name: str
    temp_dir: Path
    group: int
    """Process group of everything ``ray start`` left running for this node."""
    private_dirs: tuple[Path, ...] = ()
    """Directories this node sees as its own (tmpfs in its mount namespace)."""
    raylet_pid: int | None = None

    def view(self, path: Path) -> Path:
        """``path`` as this node sees it (through its raylet's root for a private directory)."""
        if any(path == d or d in path.parents for d in self.private_dirs):
            return Path(f"/proc/{self.raylet_pid}/root{path}")
        return path


@dataclass
class LocalRayCluster:
    root: Path
    env: dict[str, str]
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    nodes: list[RayNode] = field(default_factory=list)
    gcs_address: str | None = None
    dashboard_url: str | None = None

    def node_env(self) -> dict[str, str]:
        return {**self.env, MARKER_ENV: self.marker}

    def start_head(self, *, num_cpus: int, num_gpus: int, resources: dict[str, float]) -> RayNode:
        def once(name: str) -> RayNode:
            gcs_port, dashboard_port = free_port(), free_port()
            node = self._start(name, ["--head", "--port", str(gcs_port), "--include-dashboard", "true",
                                      "--dashboard-port", str(dashboard_port),
                                      "--ray-client-server-port", str(free_port())],
                               num_cpus=num_cpus, num_gpus=num_gpus, resources=resources)
            self.gcs_address = f"{node_ip()}:{gcs_port}"
            self.dashboard_url = f"http://127.0.0.1:{dashboard_port}"
            return node

        return self._start_retrying("head", once, lambda: None)

    def add_worker(self, name: str, *, num_cpus: int, num_gpus: int, resources: dict[str, float],
                   private_dirs: tuple[Path, ...] = ()) -> RayNode:
        alive_before = len(self.alive_node_ids())

        def gone() -> None:  # a late registration of the failed node must not count as a second node
            _wait_gone(lambda: len(self.alive_node_ids()) > alive_before, START_TIMEOUT_S)

        return self._start_retrying(name, lambda attempt: self._start(
            attempt, ["--address", self.gcs_address], num_cpus=num_cpus, num_gpus=num_gpus, resources=resources,
            private_dirs=private_dirs), gone)

    def _start_retrying(self, name: str, start: Callable[[str], RayNode], wait_gone: Callable[[], None]) -> RayNode:
        """``start(name)``, in a start turn; a start that timed out is killed (its whole process
        group), and once it is gone from the cluster (``wait_gone``) started again as ``name-2``,
        ``name-3``, ... (tests/ray_start.py)."""
        names = (name if attempt == 1 else f"{name}-{attempt}" for attempt in itertools.count(1))

        def clean_up() -> None:
            os.killpg(self.nodes[-1].group, signal.SIGKILL)
            wait_gone()

        return start_retrying(lambda: start(next(names)), clean_up, f"ray start ({name})")

    def _start(self, name: str, args: list[str], *, num_cpus: int, num_gpus: int, resources: dict[str, float],
               private_dirs: tuple[Path, ...] = ()) -> RayNode:
        temp_dir = Path(os.path.realpath(self.root)) / name  # Ray socket paths must stay short
        temp_dir.mkdir(parents=True)
        cmd = [RAY, "start", *args, "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
               "--resources", json.dumps(resources), "--temp-dir", str(temp_dir), "--disable-usage-stats",
               "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port())]
        if private_dirs:
            mounts = " && ".join(f"mount -t tmpfs tmpfs {d}" for d in private_dirs)
            cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                   f"{mounts} && exec \"$@\"", "sh", *cmd]
        proc = subprocess.Popen(cmd, env=self.node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True, cwd=self.root)
        node = RayNode(name, temp_dir, proc.pid, private_dirs)
        self.nodes.append(node)
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start ({name}) exited with {proc.returncode}:\n{out[-4000:]}")
        node.raylet_pid = _raylet_pid(temp_dir)
        return node

    def alive_nodes(self) -> list[dict]:
        """The nodes the cluster's GCS holds alive, as its state API describes them (none before the
        head is up)."""
        import httpx

        if self.dashboard_url is None:
            return []
        answer = httpx.get(f"{self.dashboard_url}/api/v0/nodes", params={"detail": "true"}, timeout=30,
                           trust_env=False).json()
        return [n for n in answer["data"]["result"]["result"] if n["state"] == "ALIVE"]

    def alive_node_ids(self) -> list[str]:
        """The ids of the nodes the cluster's GCS holds alive (none before the head is up)."""
        return [n["node_id"] for n in self.alive_nodes()]

    def node_id_offering(self, resource: str) -> str:
        """The id of the one alive node that offers ``resource``."""
        nodes = self.alive_nodes()
        found = [n["node_id"] for n in nodes if resource in n["resources_total"]]
        assert len(found) == 1, nodes
        return found[0]

    def kill_raylet(self, node: RayNode) -> None:
        """What a lost machine looks like to the rest of the cluster: its raylet dies at once."""
        os.kill(node.raylet_pid, signal.SIGKILL)

    def processes(self) -> list:
        """Every process still running with this cluster's marker in its environment."""
        import psutil

        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            try:
                if proc.environ().get(MARKER_ENV) == self.marker:
                    found.append(proc)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        return found

    def our_processes(self) -> list[str]:
        """A run's processes still alive on the cluster: its actors, engines and router (not Ray's own)."""
        found = []
        for proc in self.processes():
            try:
                cmdline = " ".join(proc.cmdline())
            except Exception:
                continue
            if "miles_disagg" in cmdline or "train_async.py" in cmdline or cmdline.startswith(OUR_ACTORS):
                found.append(f"{proc.pid}: {cmdline[:160]}")
        return found

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL, each to the ``ray start`` process groups and at once to every other
        process with the cluster's marker (Ray's workers run in process groups of their own, and those
        of a raylet the test killed have no raylet left to stop them: waiting for them to go first
        cost the chaos run's teardown 13 s)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for node in self.nodes:
                try:
                    os.killpg(node.group, sig)
                except ProcessLookupError:
                    pass
            for proc in self.processes():
                try:
                    proc.send_signal(sig)
                except Exception:
                    pass
            if _wait_gone(self.processes, timeout_s):
                return


def node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _raylet_pid(temp_dir: Path) -> int:
    import psutil

    needle = f"--raylet_socket_name={temp_dir}/"
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].endswith("/raylet") and any(a.startswith(needle) for a in cmdline):
            return proc.info["pid"]
    raise RuntimeError(f"no raylet found for {temp_dir}")


def _wait_gone(list_processes, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not list_processes():
            return True
        time.sleep(0.5)
    return False
