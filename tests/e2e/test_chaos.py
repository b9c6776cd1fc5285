"""The chaos run (issue 30 item 6): one ``train_async.py`` run on a three-raylet cluster on this
machine (``ray start`` three times: a head offering the trainer's GPU, two rollout workers with
one GPU and the ``rollout`` resource each, so each holds one engine) survives, in order:

1. :func:`kill_an_engine_process`: the process of the engine on rollout-b is SIGKILLed;
   ``--use-fault-tolerance`` restarts it, catches it up and routes to it again;
2. :func:`lose_a_rollout_node_and_add_another`: rollout-a's raylet is killed (its engine goes with
   the node: out of the router, the run goes on with the other), then a new raylet with the
   ``rollout`` resource joins: Ray places the lost engine's bundle there, and the engine is
   started, caught up from the version store and routed to again;
3. :func:`kill_a_trainer_rank`: the trainer rank's process is SIGKILLed once a save exists;
   ``--max-trainer-restarts 1`` restarts the trainer group from that save inside the run (a
   ``full`` anchor with the next version number when the store moved past the save; the steps
   after the save run again with their records replaced).

Checked afterwards: exit 0; every step recorded once; versions strictly increasing (none reused),
each one verified whole by materializing it (those an anchor pruned from the store, from the copy
taken before the trainer kill) (checksums of every changed tensor); every consumed
sample served by one version recomputes to the logprobs the engine reported with that version
(0 misattributed); ``summary.json`` and the summary line say what was lost and recovered.

A gate (``chaos_hooks.py``) paces the run: it scores only as many samples as the test allows
(about two steps more at each fault, so generation runs during every fault), and the test lifts
it when the faults are done; the run cannot finish before.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from base_model import place_base_model
from deadlines import scaled

from miles_disagg.tracking import read_metrics

from cluster_fixtures import LocalRayCluster
from test_ray_cluster import _our_processes, _wait_for, node_id_offering

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS, BATCH, SAMPLES = 10, 4, 8
WAIT_S = scaled(300)
RUN_TIMEOUT_S = scaled(1200)


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="ch", dir="/tmp"))  # Ray socket paths must stay short
    (root / "shared").mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}",
           "MILES_DISAGG_CHAOS_GATE": str(root / "shared" / "gate")}
    env.pop("RAY_ADDRESS", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # (see test_ray_cluster.py)
    ray_cluster = LocalRayCluster(root, env)
    try:
        ray_cluster.head = ray_cluster.start_head(num_cpus=4, num_gpus=1, resources={"trainer": 1})
        ray_cluster.rollout_a = ray_cluster.add_worker("rollout-a", num_cpus=2, num_gpus=1,
                                                       resources={"rollout": 8, "chaos_a": 1})
        ray_cluster.add_worker("rollout-b", num_cpus=2, num_gpus=1, resources={"rollout": 8, "chaos_b": 1})
        yield ray_cluster
    finally:
        ray_cluster.stop()
        if not os.environ.get("MILES_DISAGG_KEEP_CHAOS_DIR"):  # set it to read the logs of a failed run
            shutil.rmtree(root, ignore_errors=True)


@dataclass
class ChaosRun:
    cluster: LocalRayCluster
    run_dir: Path
    gate: Path
    driver: subprocess.Popen | None = None
    output: str = ""
    returncode: int | None = None
    notes: dict = field(default_factory=dict)

    @property
    def store_dir(self) -> Path:
        return self.cluster.root / "shared" / "store"

    @property
    def store_copy(self) -> Path:
        """The store as it was before the trainer kill (versions a later anchor pruned)."""
        return self.cluster.root / "store-before-restart"

    @property
    def save_dir(self) -> Path:
        return self.cluster.root / "shared" / "ckpt"

    def store_holding(self, version: int) -> Path:
        from miles_disagg.weights.store import VersionStore

        return self.store_dir if version in VersionStore(self.store_dir).visible_versions() else self.store_copy

    def allow(self, steps: int) -> None:
        """Let about ``steps`` more steps' samples be scored."""
        allowed = int(self.gate.read_text()) if self.gate.exists() else 0
        self.gate.with_suffix(".new").write_text(str(allowed + steps * BATCH * SAMPLES))
        self.gate.with_suffix(".new").replace(self.gate)

    def placement(self) -> dict:
        return json.loads((self.run_dir / "placement.json").read_text())

    def engine_on(self, resource: str) -> dict:
        """``placement.json``'s entry of the engine on the node offering ``resource`` (engine
        indices follow the nodes' ids, so which worker holds engine 0 varies)."""
        node = node_id_offering(self.cluster, resource)
        [engine] = [e for e in self.placement()["engines"] if e["node_id"] == node]
        return engine

    def router_workers(self) -> list[dict]:
        import httpx

        router = self.placement()["router"]["address"]
        try:
            return httpx.get(f"{router}/list_workers", timeout=10, trust_env=False).json()["workers"]
        except httpx.HTTPError:
            self.driver.wait(timeout=60)  # the router is gone with the run
            raise AssertionError(f"the run ended:\n{self.driver.communicate()[0][-8000:]}") from None

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_steps(self, n: int) -> None:
        _wait_for(lambda: self.driver.poll() is not None or self.steps_done() >= n, RUN_TIMEOUT_S, f"step {n}")
        assert self.driver.poll() is None, f"the run ended early:\n{self.driver.communicate()[0][-6000:]}"

    def wait_routed(self, gone: set[str], what: str) -> set[str]:
        """Until the router lists two ready workers, none of them in ``gone``; returns their urls."""
        def ready() -> bool:
            assert self.driver.poll() is None, f"the run ended:\n{self.driver.communicate()[0][-6000:]}"
            workers = self.router_workers()
            return len(workers) == 2 and all(w["state"] == "ready" and w["url"] not in gone for w in workers)

        _wait_for(ready, WAIT_S, what)
        return {w["url"] for w in self.router_workers()}


def kill_an_engine_process(run: ChaosRun) -> None:
    """SIGKILL rollout-b's engine process; it is restarted (``--use-fault-tolerance``) on its node."""
    engine = run.engine_on("chaos_b")
    port = engine["address"].rsplit(":", 1)[1]
    for proc in run.cluster.processes():
        cmdline = proc.cmdline()
        if "miles_disagg.engines.builtin" in " ".join(cmdline) and port in cmdline:
            proc.send_signal(signal.SIGKILL)
            break
    else:
        raise AssertionError(f"no engine process serves port {port}")
    started = time.monotonic()
    run.allow(2)
    _wait_for(lambda: engine["address"] not in {w["url"] for w in run.router_workers()}, WAIT_S, "the engine out")
    run.wait_routed({engine["address"]}, "the engine restarted and routed again")
    run.notes["engine_restart_s"] = round(time.monotonic() - started, 1)


def lose_a_rollout_node_and_add_another(run: ChaosRun) -> None:
    """Kill rollout-a's raylet, see the run go on with the other engine, then start a new rollout
    raylet and wait for rollout-a's engine to be placed there, caught up and routed to."""
    cluster = run.cluster
    lost = run.engine_on("chaos_a")
    lost_url, run.notes["lost_engine"], run.notes["lost_node"] = lost["address"], lost["engine"], lost["node_id"]
    steps_before = run.steps_done()
    cluster.kill_raylet(cluster.rollout_a)
    killed = time.monotonic()
    run.allow(2)
    _wait_for(lambda: lost_url not in {w["url"] for w in run.router_workers()}, WAIT_S, "the engine out of the router")
    run.notes["engine_out_after_s"] = round(time.monotonic() - killed, 1)
    run.wait_steps(steps_before + 1)  # the run goes on with one engine
    join_a_rollout_node(cluster)
    joined = time.monotonic()
    run.allow(2)
    run.notes["new_node"] = node_id_offering(cluster, "chaos_c")
    run.wait_routed({lost_url}, "the lost engine placed on the new node and routed again")
    run.notes["replaced_after_join_s"] = round(time.monotonic() - joined, 1)


def join_a_rollout_node(cluster: LocalRayCluster, attempts: int = 3) -> None:
    """``ray start`` of a new rollout raylet (offering ``chaos_c``). Ray gives a starting raylet a
    fixed 30 s to register with the GCS; on this loaded machine that may not be enough, so a start
    that timed out is stopped and tried again."""
    for attempt in range(1, attempts + 1):
        try:
            cluster.add_worker(f"rollout-c{attempt}", num_cpus=2, num_gpus=1, resources={"rollout": 8, "chaos_c": 1})
            return
        except RuntimeError as exc:
            if "timed out during startup" not in str(exc) or attempt == attempts:
                raise
            os.killpg(cluster.nodes[-1].group, signal.SIGKILL)
            _wait_for(lambda: not _alive_offering(cluster, "chaos_c"), WAIT_S, "the failed raylet to be gone")


def _alive_offering(cluster: LocalRayCluster, resource: str) -> bool:
    try:
        node_id_offering(cluster, resource)
        return True
    except AssertionError:
        return False


def kill_a_trainer_rank(run: ChaosRun) -> None:
    """Once a save exists, copy the store (an anchor published by the restart prunes the versions
    before it; the attribution check still needs them), SIGKILL the trainer rank's process, and
    wait for the restart's record and a step after it."""
    from miles_disagg.trainer.checkpoint import find_latest

    run.allow(2)
    _wait_for(lambda: find_latest(run.save_dir) is not None, WAIT_S, "a save of the trainer")
    shutil.copytree(run.store_dir, run.store_copy, ignore=shutil.ignore_patterns(".staging*", "*.partial"))
    steps_before = run.steps_done()
    for proc in run.cluster.processes():
        if " ".join(proc.cmdline()).startswith("ray::TrainerRank"):
            proc.send_signal(signal.SIGKILL)
            break
    else:
        raise AssertionError("no trainer rank process found")
    killed = time.monotonic()
    run.allow(3)
    events = run.run_dir / "events.jsonl"
    _wait_for(lambda: run.driver.poll() is not None or (events.exists() and events.read_text().strip()), WAIT_S,
              "the trainer's restart record")
    run.wait_steps(steps_before + 1)
    run.notes["trainer_restart_s"] = round(time.monotonic() - killed, 1)


CHAOS = [kill_an_engine_process, lose_a_rollout_node_and_add_another, kill_a_trainer_rank]


@pytest.fixture(scope="module")
def chaos_run(cluster: LocalRayCluster, digits_base_model: Path) -> ChaosRun:
    root = cluster.root
    place_base_model(digits_base_model, root / "shared")
    run = ChaosRun(cluster, root / "shared" / "run", Path(cluster.env["MILES_DISAGG_CHAOS_GATE"]))
    run.allow(2)
    restarts = ["--max-trainer-restarts", "1", "--save-interval", "2", "--save", str(run.save_dir)]
    cmd = [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", cluster.dashboard_url,
           "--working-dir", str(REPO), "--", "python", "train_async.py", "--config", "configs/tiny_cpu.yaml",
           "--run-dir", str(run.run_dir), "--hf-checkpoint", str(root / "shared" / "base-model"),
           "--rollout-batch-size", str(BATCH), "--global-batch-size", "32", "--num-rollout", str(STEPS),
           "--rollout-num-gpus", "2", "--rollout-node-resource", "rollout", "--use-fault-tolerance",
           "--update-weight-disk-dir", str(run.store_dir),
           "--custom-rm-path", "chaos_hooks.reward",
           "--save-debug-rollout-data", str(run.run_dir / "consumed" / "{rollout_id}.jsonl"), *restarts]
    run.driver = subprocess.Popen(cmd, env=cluster.node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=root)
    try:
        run.wait_steps(1)
        _wait_for(lambda: (run.run_dir / "placement.json").exists(), WAIT_S, "placement.json")
        for fault in CHAOS:
            started = time.monotonic()
            fault(run)
            run.notes[f"{fault.__name__}_s"] = round(time.monotonic() - started, 1)
        run.gate.unlink()  # the faults are done: the run goes to its end
        run.output, _ = run.driver.communicate(timeout=RUN_TIMEOUT_S)
        run.returncode = run.driver.returncode
    finally:
        run.gate.unlink(missing_ok=True)
        if run.driver.poll() is None:
            run.driver.kill()
    print("chaos:", json.dumps(run.notes))
    return run


def test_the_chaos_run_finishes_with_every_step_recorded_once(chaos_run: ChaosRun) -> None:
    assert chaos_run.returncode == 0, chaos_run.output[-8000:]
    assert [r["step"] for r in read_metrics(chaos_run.run_dir / "metrics.jsonl")] == list(range(STEPS))
    assert chaos_run.notes["engine_out_after_s"] < 30  # Ray said the node was gone: no health-check timeouts
    _wait_for(lambda: not _our_processes(chaos_run.cluster), 120, "the run's processes to end")


def test_versions_are_published_once_each_and_whole(chaos_run: ChaosRun, tmp_path: Path) -> None:
    from miles_disagg.weights.materializer import Materializer

    updates = read_metrics(chaos_run.run_dir / "updates.jsonl")
    versions = [u["weights/version"] for u in updates]
    assert versions == sorted(set(versions)) and len(versions) >= STEPS  # strictly increasing: none reused
    for update in updates:  # every engine that served reported the version just activated
        assert {v for v in update["weights/engine_versions"] if v is not None} <= {str(update["weights/version"])}
    host = Materializer(tmp_path / "local", base_dir=chaos_run.cluster.root / "shared" / "base-model")
    try:
        for version in versions:  # each verified: every changed tensor's checksum
            assert host.prepare(chaos_run.store_holding(version), version).ref.version == version
    finally:
        host.close()


def test_no_sample_is_misattributed(chaos_run: ChaosRun, tmp_path: Path) -> None:
    """Every consumed sample served by one version recomputes, with that version's weights, to the
    logprobs the engine reported: 0 misattributed (the attribution check of test_miles_rollout_code)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles_disagg.weights.materializer import Materializer

    by_version: dict[int, list[dict]] = {}
    for step in range(STEPS):
        lines = (chaos_run.run_dir / "consumed" / f"{step}.jsonl").read_text().splitlines()
        for group in map(json.loads, lines):
            for sample in group["samples"]:
                if sample["weight_version_start"] == sample["weight_version_end"]:
                    by_version.setdefault(sample["weight_version_start"], []).append(sample)
    host = Materializer(tmp_path / "local", base_dir=chaos_run.cluster.root / "shared" / "base-model")
    misattributed, checked = 0, 0
    try:
        for version in sorted(by_version):
            path = host.prepare(chaos_run.store_holding(version), version).path if version else \
                chaos_run.cluster.root / "shared" / "base-model"
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for sample in by_version[version]:
                prompt, response = sample["prompt_ids"], sample["response_ids"]
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
                logprobs = torch.log_softmax(logits, dim=-1)  # --rollout-temperature 1.0
                diffs = [abs(float(logprobs[len(prompt) - 1 + i, token]) - sample["response_logprobs"][i])
                         for i, token in enumerate(response)]
                misattributed += max(diffs) > 1e-3
                checked += 1
    finally:
        host.close()
    assert checked >= STEPS * BATCH * SAMPLES * 0.8 and misattributed == 0, (checked, misattributed)


def test_the_summary_says_what_was_lost_and_recovered(chaos_run: ChaosRun) -> None:
    summary = json.loads((chaos_run.run_dir / "summary.json").read_text())
    faults = summary["engine_faults"]
    lost = chaos_run.notes["lost_engine"]
    assert faults["nodes_lost"] == [chaos_run.notes["lost_node"]] and faults["engines_lost_with_node"] == [lost]
    assert faults["replaced"] >= 1 and faults["restored"] >= 2 and faults["not_restarted"] == []
    events = json.loads((chaos_run.run_dir / "engine_events.json").read_text())
    replaced = [e for e in events if e["event"] == "replaced"]
    assert replaced[-1]["engine"] == lost and replaced[-1]["node_id"] == chaos_run.notes["new_node"]
    line = next(x for x in chaos_run.output.splitlines() if x.startswith("engines: "))
    assert line.startswith(f"engines: 1 node(s) lost (engines [{lost}]), "), line
    [restart] = summary["trainer_restarts"]
    assert restart["restart"] == 1 and restart["max_restarts"] == 1 and "trainer rank" in restart["failed"]
    assert "trainer restart 1 of 1" in chaos_run.output
