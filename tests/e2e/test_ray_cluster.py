"""A run on an existing two-node Ray cluster, both raylets on this machine (``ray start`` twice).

The head offers the trainer's logical GPU; the worker offers two logical GPUs and a ``rollout``
resource and runs in a private mount namespace whose ``worker-local`` directory is a tmpfs the
head cannot see (its "local disk"). Checked, as a user would run it:

* ``ray job submit --working-dir . -- python train_async.py ... --rollout-node-resource rollout``
  runs the engines on the worker and the trainer on the head (``placement.json``), the engines'
  local checkpoints are written under the worker's local directory (invisible to the driver),
  and every step's engines served the trainer's version;
* a version store the rollout node cannot read fails the run (exit 2) naming the node and path;
* killing the worker's raylet mid-run (both engines were there) takes the engines out; with
  no node to place them on again within ``--min-rollout-engines-timeout`` the run ends with
  exit 1 and one line naming the lost node, and nothing of the run is left running (a lost
  rollout node the run survives: ``test_chaos.py``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from deadlines import scaled

from miles_disagg.tracking import read_metrics

from cluster_fixtures import LocalRayCluster, RayNode
from run_waits import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # a cluster and three runs in the module (scaled by the load)

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = scaled(900)
STEPS = 3
CAPACITY_TIMEOUT_S = 14
"""The lost-engines run's ``--min-rollout-engines-timeout``: the run waits it out idle after the loss is
seen, and its wait for groups must last past one progress line (``EVERY_S`` 10 s). (20 before: 6 s of
the suite's time more.)"""


def _can_unshare() -> bool:
    return shutil.which("unshare") is not None and subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def cluster():
    if not _can_unshare():
        pytest.skip("needs unshare --mount (root) to give the worker raylet a local disk of its own")
    root = Path(tempfile.mkdtemp(prefix="rc", dir="/tmp"))  # Ray socket paths must stay short
    (root / "shared").mkdir()
    (root / "worker-local").mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}  # as if installed
    env.pop("RAY_ADDRESS", None)
    # a submitted job runs from its unpacked working directory, which holds no byte code: let its
    # processes write it there, as Python does by default (this machine's environment forbids it,
    # and every actor of the job would compile the package again)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    ray_cluster = LocalRayCluster(root, env)
    try:
        ray_cluster.head = ray_cluster.start_head(num_cpus=4, num_gpus=1, resources={"trainer": 1})
        ray_cluster.worker = ray_cluster.add_worker("worker", num_cpus=4, num_gpus=2, resources={"rollout": 8},
                                                    private_dirs=(root / "worker-local",))
        yield ray_cluster
    finally:
        ray_cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


def run_args(root: Path, name: str, *extra: str) -> list[str]:
    return ["train_async.py", "--config", "configs/tiny_cpu.yaml", "--run-dir", str(root / "shared" / name),
            "--hf-checkpoint", str(root / "shared" / "base-model"), "--hf-checkpoint-init", "tiny-qwen3-digits",
            "--rollout-batch-size", "4",
            "--global-batch-size", "32", "--rollout-num-gpus", "2", "--rollout-node-resource", "rollout", *extra]


@pytest.fixture(scope="module")
def submitted_run(cluster: LocalRayCluster) -> Path:
    root = cluster.root
    cmd = [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", cluster.dashboard_url,
           "--working-dir", str(REPO), "--", "python",
           *run_args(root, "run", "--num-rollout", str(STEPS), "--update-weight-disk-dir", str(root / "shared/store"),
                     "--update-weight-local-checkpoint-dir", str(root / "worker-local/checkpoints"))]
    result = subprocess.run(cmd, env=cluster.node_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=root)
    assert result.returncode == 0, (result.stdout + result.stderr)[-8000:]
    return root / "shared" / "run"


def test_a_submitted_run_puts_the_engines_on_the_rollout_node(cluster: LocalRayCluster, submitted_run: Path) -> None:
    placement = json.loads((submitted_run / "placement.json").read_text())
    worker_id, head_id = cluster.node_id_offering("rollout"), cluster.node_id_offering("trainer")
    assert placement["spans_nodes"] is True
    assert [r["node_id"] for r in placement["trainer"]] == [head_id]
    assert [e["node_id"] for e in placement["engines"]] == [worker_id, worker_id]
    assert placement["driver"]["node_id"] == head_id  # a submitted job's driver runs on the head
    for entry in placement["trainer"] + placement["engines"]:
        assert entry["node_ip"] and entry["gpu_ids"] and entry["address"]
    assert sorted(g for e in placement["engines"] for g in e["gpu_ids"]) == ["0", "1"]
    # across nodes, engines bind their node's address (not loopback), so the router reaches them
    assert all(e["address"].startswith(f"http://{e['node_ip']}:") for e in placement["engines"])


def test_the_engines_local_checkpoints_are_on_the_rollout_nodes_own_disk(cluster: LocalRayCluster,
                                                                         submitted_run: Path) -> None:
    placement = json.loads((submitted_run / "placement.json").read_text())
    local = cluster.root / "worker-local" / "checkpoints"
    assert [e["local_checkpoint_dir"] for e in placement["engines"]] == [str(local / "engine-0"),
                                                                         str(local / "engine-1")]
    worker: RayNode = cluster.worker
    for index in range(2):
        written = list(worker.view(local / f"engine-{index}").iterdir())
        assert written, f"engine {index} wrote nothing into its local checkpoint"
    assert not local.exists()  # the driver's node never saw (or needed) it


def test_every_step_the_engines_served_the_trainers_version(submitted_run: Path) -> None:
    records = read_metrics(submitted_run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))
    updates = read_metrics(submitted_run / "updates.jsonl")
    assert [(u["step"], u["weights/version"], u["weights/engine_versions"]) for u in updates] == [
        (step, step + 1, [str(step + 1)] * 2) for step in range(STEPS)]


def test_a_store_the_rollout_node_cannot_read_fails_before_training(cluster: LocalRayCluster,
                                                                    submitted_run: Path) -> None:
    root = cluster.root
    store = root / "worker-local" / "store"  # written on the head's disk; the worker sees its own tmpfs
    env = {**cluster.node_env(), "RAY_ADDRESS": cluster.gcs_address}  # a driver joining by RAY_ADDRESS
    result = subprocess.run([sys.executable, *run_args(root, "unreadable", "--num-rollout", "2",
                                                        "--update-weight-disk-dir", str(store))],
                            env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO)
    assert result.returncode == 2, result.stderr[-6000:]
    last = result.stderr.strip().splitlines()[-1]
    worker_id = cluster.node_id_offering("rollout")
    assert last.startswith("train_async.py: error: a rollout node lacks a shared path: "
                           f"--update-weight-disk-dir '{store}': no such directory on node "), last
    assert f"(id {worker_id}) (engine 0, engine 1)" in last
    assert not (root / "shared" / "unreadable" / "metrics.jsonl").exists()
    assert not list(store.glob(".store-probe-*"))  # the probe is removed


def test_serve_ray_runs_its_replicas_on_the_rollout_node(cluster: LocalRayCluster, submitted_run: Path) -> None:
    from cluster_fixtures import node_ip

    from miles_disagg.service.client import GatewayClient

    root, worker = cluster.root, cluster.worker
    work = root / "worker-local" / "service"
    serve = ["serve", "ray", "--address", cluster.gcs_address, "--store", str(root / "shared/store"),
             "--base-dir", str(root / "shared/base-model"), "--work-dir", str(work), "--replica-resource", "rollout",
             "--min-replicas", "1", "--max-replicas", "1", "--port", "0", "--poll-interval", "0.5"]
    refused = subprocess.run(miles_disagg(*serve), env=cluster.node_env(), capture_output=True, text=True, timeout=scaled(300))
    assert refused.returncode == 2, refused.stderr[-4000:]
    assert refused.stderr.strip().splitlines()[-1].startswith(
        "miles-disagg serve: error: --host 127.0.0.1: this Ray cluster has 2 nodes")
    nowhere = subprocess.run(miles_disagg(*serve, "--host", node_ip(), "--replica-resource", "nowhere"),
                             env=cluster.node_env(), capture_output=True, text=True, timeout=scaled(300))
    assert nowhere.returncode == 2, nowhere.stderr[-4000:]
    assert nowhere.stderr.strip().splitlines()[-1] == (
        "miles-disagg serve: error: --replica-resource 'nowhere': no node of this Ray cluster offers it")
    proc = subprocess.Popen(miles_disagg(*serve, "--host", node_ip()), env=cluster.node_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("miles-disagg serve ray: gateway http://"), line
        with GatewayClient(line.split()[-1]) as client:
            client.wait_converged(STEPS, num_replicas=1, timeout_s=scaled(300))  # the run's newest version, from the store
        actors = _actors(cluster, "ReplicaActor")
        assert [a["node_id"] for a in actors] == [cluster.node_id_offering("rollout")]
        assert list(worker.view(work / "ray-0").iterdir())  # its local checkpoint, on the worker's own disk
        assert not (work / "ray-0").exists()  # (the driver's node has only the gateway's log there)
    finally:
        proc.terminate()
        proc.wait(timeout=scaled(120))
    wait_for(lambda: not cluster.our_processes(), scaled(120), "the service's processes to end")


def miles_disagg(*args: str) -> list[str]:
    return [sys.executable, "-m", "miles_disagg.cli", *args]


def _actors(cluster: LocalRayCluster, class_name: str) -> list[dict]:
    import httpx

    answer = httpx.get(f"{cluster.dashboard_url}/api/v0/actors", params={"detail": "true", "limit": "1000"},
                       timeout=30, trust_env=False).json()
    return [a for a in answer["data"]["result"]["result"] if a["class_name"] == class_name and a["state"] == "ALIVE"]


def test_losing_every_rollout_engine_for_too_long_ends_the_run_naming_the_node(cluster: LocalRayCluster,
                                                                               submitted_run: Path) -> None:
    root = cluster.root
    run_dir = root / "shared" / "lost"
    worker_id = cluster.node_id_offering("rollout")
    env = {**cluster.node_env(), "RAY_ADDRESS": cluster.gcs_address}
    driver = subprocess.Popen([sys.executable, *run_args(root, "lost", "--num-rollout", "200",
                                                         "--min-rollout-engines-timeout", str(CAPACITY_TIMEOUT_S))],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        wait_for(lambda: driver.poll() is not None or _steps_done(run_dir) >= 1, RUN_TIMEOUT_S, "a first step")
        assert driver.poll() is None, driver.communicate()[1][-6000:]
        assert cluster.our_processes()  # (what must be gone at the end is running now)
        cluster.kill_raylet(cluster.worker)
        killed = time.monotonic()
        _, stderr = driver.communicate(timeout=RUN_TIMEOUT_S)
        print(f"the run ended {time.monotonic() - killed:.1f}s after the worker's raylet was killed")
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 1, stderr[-6000:]
    last = stderr.strip().splitlines()[-1]
    # the cause of each engine's loss as Ray names it (before its GCS has declared the node dead: down)
    cause = rf"(its node \(id {worker_id}\) left the Ray cluster|down \(its process exited or it failed its health checks\))"
    assert re.fullmatch(r"train_async\.py: failed: RolloutCapacityLost: only 0 of 2 rollout engine\(s\) served for "
                        r"\d+s, fewer than --min-rollout-engines 1 for longer than "
                        rf"--min-rollout-engines-timeout {CAPACITY_TIMEOUT_S}s; "
                        rf"engine 0: {cause}; engine 1: {cause}", last), last
    # the wait for groups with no engine serving is not silent: a line at least every 10 s
    assert re.search(r"still waiting for \d+ groups from the rollout \(\d+s\): \d of 2 engine\(s\) serving", stderr), \
        stderr[-6000:]
    summary = json.loads((run_dir / "summary.json").read_text())  # every run that ends leaves one
    assert summary["ended"] == "failed" and summary["end_reason"] == last.removeprefix("train_async.py: failed: ")
    assert summary["steps"] >= 1
    wait_for(lambda: not cluster.our_processes(), scaled(120), "the run's processes to end")


def _steps_done(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0
