"""The chaos run (issue 30 item 6): one ``train_async.py`` run on a three-raylet cluster on this
machine (``ray start`` three times: a head offering the trainer's GPU, two rollout workers with
one GPU and the ``rollout`` resource each, so each holds one engine) survives, in order:

0. :func:`stall_the_router` and :func:`kill_the_router`: the router process is SIGSTOPped for 8 s
   (the monitor's ``/health`` probes time out meanwhile; the run's calls to it wait and go through
   once it answers: it is not restarted), then SIGKILLed
   (the engine manager starts it again at its address with both engines registered again); the run
   trains on through both;
1. :func:`kill_an_engine_process`: the process of the engine on rollout-b is SIGKILLed;
   ``--use-fault-tolerance`` restarts it, catches it up and routes to it again;
2. :func:`lose_a_rollout_node_and_add_another`: rollout-a's raylet is killed (its engine goes with
   the node: out of the router, the run goes on with the other), then a new raylet with the
   ``rollout`` resource joins: Ray places the lost engine's bundle there, and the engine is
   started, caught up from the version store and routed to again;
3. :func:`kill_a_trainer_rank`: the trainer rank's process is SIGKILLed while the run stands between
   two saves (versions published after the newest save); ``--max-trainer-restarts 1`` restarts the
   trainer group from that save inside the run: a ``full`` anchor with the next version number,
   the versions after the save leave the lineage, and the steps after the save run again with
   their records replaced.

Checked afterwards: exit 0; every step recorded once, with one optimizer step each; versions
strictly increasing (none reused), each one verified whole by materializing it (those an anchor
pruned from the store, from the copy taken at the trainer kill) (checksums of every changed
tensor), the store without a gap from its anchor and ``weights verify`` passing; every consumed
sample served by one version recomputes to the logprobs the engine reported with that version (0
misattributed); the restart resumed from the save before the kill, at ``LATEST + 1``, and no step
after it trained on a sample of a version that left the lineage; ``summary.json``, the log and the
summary line say what was lost and recovered. (This run carries the checks of
the former trainer-restart run: one whole run fewer.)

A gate (``scoring_gate.py``) paces the run: it scores only as many samples as the test allows
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
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from attribution import count_misattributed, samples_by_version
from base_model import place_base_model
from deadlines import scaled

from miles_disagg.tracking import read_metrics, read_records

from cluster_fixtures import MARKER_ENV, LocalRayCluster
from scoring_gate import GATE_ENV, allow
from run_waits import wait_for
from trainer_faults import trainer_rank_pids

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS, BATCH, SAMPLES = 13, 4, 8  # room for the faults: CI's run stood at step 8 of 10 when its node was lost
WAIT_S = scaled(300)
RUN_TIMEOUT_S = scaled(1200)


@pytest.fixture(scope="module")
def cluster():
    root = Path(tempfile.mkdtemp(prefix="ch", dir="/tmp"))  # Ray socket paths must stay short
    (root / "shared").mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{REPO}{os.pathsep}{HERE}",
           GATE_ENV: str(root / "shared" / "gate")}
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
        allow(self.gate, steps * BATCH * SAMPLES)

    def placement(self) -> dict:
        return json.loads((self.run_dir / "placement.json").read_text())

    def engine_on(self, resource: str) -> dict:
        """``placement.json``'s entry of the engine on the node offering ``resource`` (engine
        indices follow the nodes' ids, so which worker holds engine 0 varies)."""
        node = self.cluster.node_id_offering(resource)
        [engine] = [e for e in self.placement()["engines"] if e["node_id"] == node]
        return engine

    def router_workers(self, ended: bool = True) -> list[dict]:
        """The router's workers; ``ended``: a router that does not answer means the run ended (else: [])."""
        import httpx

        router = self.placement()["router"]["address"]
        try:
            return httpx.get(f"{router}/list_workers", timeout=10, trust_env=False).json()["workers"]
        except httpx.HTTPError:
            if not ended and self.driver.poll() is None:
                return []  # being started again
            self.driver.wait(timeout=60)  # the router is gone with the run
            raise AssertionError(f"the run ended:\n{self.driver.communicate()[0][-8000:]}") from None

    def router_process(self, wait_s: float = WAIT_S):
        """The router's process (``python -m miles_disagg.router`` on the address in ``placement.json``);
        None when ``wait_s`` is 0 and none runs."""
        port = self.placement()["router"]["address"].rsplit(":", 1)[1]

        def find():
            for proc in self.cluster.processes():
                try:
                    cmdline = proc.cmdline()
                except Exception:
                    continue
                if cmdline[1:3] == ["-m", "miles_disagg.router"] and port in cmdline and proc.status() != "zombie":
                    return proc
            return None

        if wait_s == 0:
            return find()
        wait_for(lambda: find() is not None, wait_s, "the router's process")
        return find()

    def driver_process(self):
        """The run's driver (``python train_async.py``, started by the job's supervisor on the head)."""
        import psutil

        def is_driver(proc) -> bool:
            try:
                return proc.cmdline()[1:2] == ["train_async.py"]
            except (psutil.Error, IndexError):
                return False

        wait_for(lambda: any(map(is_driver, self.cluster.processes())), WAIT_S, "the run's driver process")
        return next(p for p in self.cluster.processes() if is_driver(p))

    def restart_event(self) -> dict:
        [event] = read_records(self.run_dir / "events.jsonl")
        return event

    def steps_done(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def wait_steps(self, n: int) -> None:
        wait_for(lambda: self.driver.poll() is not None or self.steps_done() >= n, RUN_TIMEOUT_S, f"step {n}")
        assert self.driver.poll() is None, f"the run ended early:\n{self.driver.communicate()[0][-6000:]}"

    def wait_steps_paced(self, n: int) -> None:
        """:meth:`wait_steps`, letting one more step's samples be scored whenever no step was recorded for
        a while (held at the gate: groups dropped as stale, or retried after a router fault, used up the share)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        seen, since = self.steps_done(), time.monotonic()
        while self.steps_done() < n:
            assert self.driver.poll() is None, f"the run ended early:\n{self.driver.communicate()[0][-6000:]}"
            assert time.monotonic() < deadline, f"step {n} not reached within {RUN_TIMEOUT_S}s"
            if self.steps_done() != seen:
                seen, since = self.steps_done(), time.monotonic()
            elif time.monotonic() - since > scaled(5):
                self.allow(1)
                since = time.monotonic()
            time.sleep(0.2)

    def wait_routed(self, gone: set[str], what: str) -> set[str]:
        """Until the router lists two ready workers, none of them in ``gone``; returns their urls."""
        def ready() -> bool:
            assert self.driver.poll() is None, f"the run ended:\n{self.driver.communicate()[0][-6000:]}"
            workers = self.router_workers()
            return len(workers) == 2 and all(w["state"] == "ready" and w["url"] not in gone for w in workers)

        wait_for(ready, WAIT_S, what)
        return {w["url"] for w in self.router_workers()}


ROUTER_STALL_S = 8.0
"""Longer than one of the monitor's ``/health`` probes and the interval between two (``HEALTH_TIMEOUT_S``
5 s + ``--rollout-health-check-interval`` 1 s: at least one probe goes unanswered), far shorter than the
keeper's bound before a restart (``STALL_BOUND_S`` 45 s). (15 s before: 7 s of the suite's time more.)"""


def stall_the_router(run: ChaosRun) -> None:
    """SIGSTOP the router process for :data:`ROUTER_STALL_S`, then SIGCONT: the run trains on, not restarted."""
    from miles_disagg.fleet.router_keeper import HEALTH_TIMEOUT_S, STALL_BOUND_S

    assert HEALTH_TIMEOUT_S + 1.0 < ROUTER_STALL_S < STALL_BOUND_S / 2  # a probe unanswered, no restart due
    router = run.router_process()
    steps = run.steps_done()
    router.suspend()
    try:
        assert not threading.Event().wait(ROUTER_STALL_S)  # the fault is the stall itself: a stopped router
    finally:
        router.resume()
    run.allow(1)
    run.wait_steps_paced(steps + 1)
    assert run.router_process().pid == router.pid
    run.notes["router_stalled_s"] = ROUTER_STALL_S


def kill_the_router(run: ChaosRun) -> None:
    """SIGKILL the router process: started again at its address, both engines registered again."""
    router = run.router_process()
    steps = run.steps_done()
    router.kill()
    killed = time.monotonic()
    run.allow(1)
    wait_for(lambda: run.router_process(wait_s=0) not in (None, router) and len(run.router_workers(ended=False)) == 2,
             WAIT_S, "the router started again with both engines")
    run.notes["router_back_after_s"] = round(time.monotonic() - killed, 1)
    run.wait_steps_paced(steps + 1)


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
    wait_for(lambda: engine["address"] not in {w["url"] for w in run.router_workers()}, WAIT_S, "the engine out")
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
    wait_for(lambda: lost_url not in {w["url"] for w in run.router_workers()}, WAIT_S, "the engine out of the router")
    run.notes["engine_out_after_s"] = round(time.monotonic() - killed, 1)
    run.wait_steps(steps_before + 1)  # the run goes on with one engine
    join_a_rollout_node(cluster)
    joined = time.monotonic()  # no steps let through meanwhile: placing the engine waits on no step
    run.notes["new_node"] = cluster.node_id_offering("chaos_c")
    run.wait_routed({lost_url}, "the lost engine placed on the new node and routed again")
    run.notes["replaced_after_join_s"] = round(time.monotonic() - joined, 1)


def join_a_rollout_node(cluster: LocalRayCluster) -> None:
    """``ray start`` of a new rollout raylet (offering ``chaos_c``); Ray gives a starting raylet a
    fixed 30 s to register with the GCS, and a start that timed out on a loaded machine is stopped
    and made once more (``LocalRayCluster.add_worker``)."""
    cluster.add_worker("rollout-c", num_cpus=2, num_gpus=1, resources={"rollout": 8, "chaos_c": 1})


def kill_a_trainer_rank(run: ChaosRun) -> None:
    """SIGKILL the trainer rank's process while the run stands between two saves, then wait for
    the restart's record.

    With ``--save-interval 2`` an odd number of recorded steps means: the newest save is the step
    before (complete: saves are written by the driver before it goes on), the version of the last
    recorded step (and maybe the next) is published after it, and no save is in progress. The
    driver is stopped (SIGSTOP) while this is read, the store copied (an anchor published by the
    restart prunes the versions before it; the attribution check still needs them) and the rank
    killed, so the run cannot move on in between. The faults are done once the restart is recorded:
    the fixture lifts the gate then."""
    from miles_disagg.trainer.checkpoint import find_latest
    from miles_disagg.weights.store import VersionStore

    run.allow(2)
    driver = run.driver_process()
    deadline = time.monotonic() + WAIT_S
    last_progress = (run.steps_done(), time.monotonic())
    while True:
        driver.suspend()
        try:
            steps, save = run.steps_done(), find_latest(run.save_dir)
            if steps % 2 == 1 and save is not None and save[1].step == steps - 1:
                shutil.copytree(run.store_dir, run.store_copy, ignore=shutil.ignore_patterns(".staging*", "*.partial"))
                [rank] = trainer_rank_pids(env=(MARKER_ENV, run.cluster.marker))
                os.kill(rank, signal.SIGKILL)
                break
        finally:
            driver.resume()
        assert run.driver.poll() is None, f"the run ended early:\n{run.driver.communicate()[0][-6000:]}"
        assert time.monotonic() < deadline, f"the run never stood between two saves (at step {steps})"
        if run.steps_done() != last_progress[0]:
            last_progress = (run.steps_done(), time.monotonic())
        elif time.monotonic() - last_progress[1] > 5:  # held at the gate on an even step: one step more
            run.allow(1)
            last_progress = (run.steps_done(), time.monotonic())
        time.sleep(0.2)
    killed = time.monotonic()
    wait_for(lambda: rank not in trainer_rank_pids(env=(MARKER_ENV, run.cluster.marker)), WAIT_S,
              "the killed rank to be gone")
    run.notes.update(killed_at_step=steps, save_step=save[1].step, save_version=save[1].version,
                     latest_at_kill=VersionStore(run.store_dir).latest().version)  # the dead rank publishes no more
    run.allow(3)
    events = run.run_dir / "events.jsonl"
    wait_for(lambda: run.driver.poll() is not None or (events.exists() and events.read_text().strip()), WAIT_S,
              "the trainer's restart record")
    assert run.driver.poll() is None, f"the run ended:\n{run.driver.communicate()[0][-6000:]}"
    run.notes["trainer_restart_s"] = round(time.monotonic() - killed, 1)


CHAOS = [stall_the_router, kill_the_router, kill_an_engine_process, lose_a_rollout_node_and_add_another,
         kill_a_trainer_rank]


@pytest.fixture(scope="module")
def chaos_run(cluster: LocalRayCluster, digits_base_model: Path) -> ChaosRun:
    root = cluster.root
    place_base_model(digits_base_model, root / "shared")
    run = ChaosRun(cluster, root / "shared" / "run", Path(cluster.env[GATE_ENV]))
    run.allow(2)
    restarts = ["--max-trainer-restarts", "1", "--save-interval", "2", "--save", str(run.save_dir)]
    cmd = [str(Path(sys.executable).with_name("ray")), "job", "submit", "--address", cluster.dashboard_url,
           "--working-dir", str(REPO), "--", "python", "train_async.py", "--config", "configs/tiny_cpu.yaml",
           "--run-dir", str(run.run_dir), "--hf-checkpoint", str(root / "shared" / "base-model"),
           "--rollout-batch-size", str(BATCH), "--global-batch-size", "32", "--num-rollout", str(STEPS),
           "--rollout-num-gpus", "2", "--rollout-node-resource", "rollout", "--use-fault-tolerance",
           "--update-weight-disk-dir", str(run.store_dir),
           "--custom-rm-path", "scoring_gate.reward",
           "--save-debug-rollout-data", str(run.run_dir / "consumed" / "{rollout_id}.jsonl"), *restarts]
    run.driver = subprocess.Popen(cmd, env=cluster.node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, cwd=root)
    try:
        run.wait_steps(1)
        wait_for(lambda: (run.run_dir / "placement.json").exists(), WAIT_S, "placement.json")
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
    per_step = Counter(r["rollout_step"] for r in read_records(chaos_run.run_dir / "train_steps.jsonl"))
    assert sorted(per_step) == list(range(STEPS)) and set(per_step.values()) == {1}  # one optimizer step each
    assert chaos_run.notes["engine_out_after_s"] < 30  # Ray said the node was gone: no health-check timeouts
    wait_for(lambda: not chaos_run.cluster.our_processes(), scaled(120), "the run's processes to end")


def test_versions_are_published_once_each_and_whole(chaos_run: ChaosRun, tmp_path: Path) -> None:
    from miles_disagg.weights.materializer import Materializer

    updates = read_metrics(chaos_run.run_dir / "updates.jsonl")
    versions = [u["weights/version"] for u in updates]
    assert versions == sorted(set(versions)) and len(versions) >= STEPS  # strictly increasing: none reused
    for update in updates:  # every engine that served reported the version just activated
        assert {v for v in update["weights/engine_versions"] if v is not None} <= {str(update["weights/version"])}
    recorded = [r["weights/version"] for r in read_metrics(chaos_run.run_dir / "metrics.jsonl")]
    assert recorded == sorted(set(recorded))  # strictly increasing across the restart
    host = Materializer(tmp_path / "local", base_dir=chaos_run.cluster.root / "shared" / "base-model")
    try:
        for version in versions:  # each verified: every changed tensor's checksum
            assert host.prepare(chaos_run.store_holding(version), version).ref.version == version
    finally:
        host.close()


def test_the_store_holds_no_gap_from_its_anchor_and_verifies(chaos_run: ChaosRun) -> None:
    from miles_disagg.weights.store import VersionStore

    store = VersionStore(chaos_run.store_dir)
    latest, visible = store.latest(), store.visible_versions()
    assert visible == list(range(visible[0], latest.version + 1))  # no gap; older than the newest anchor: pruned
    assert visible[0] == 1 or store.read_index(visible[0]).delta_encoding == "full"
    verified = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "weights", "verify", "--store",
                               str(chaos_run.store_dir), "--base-dir", str(chaos_run.cluster.root / "shared" / "base-model")],
                              capture_output=True, text=True, timeout=scaled(120))
    assert verified.returncode == 0, verified.stderr
    assert json.loads(verified.stdout)["ok"] is True


def test_no_sample_is_misattributed(chaos_run: ChaosRun, tmp_path: Path) -> None:
    """Every consumed sample served by one version recomputes, with that version's weights, to the
    logprobs the engine reported: 0 misattributed (the attribution check of test_miles_rollout_code)."""
    by_version = samples_by_version(chaos_run.run_dir / "consumed", STEPS)
    misattributed, checked = count_misattributed(by_version, chaos_run.store_holding,
                                                 chaos_run.cluster.root / "shared" / "base-model", tmp_path / "local")
    assert checked >= STEPS * BATCH * SAMPLES * 0.8 and misattributed == 0, (checked, misattributed)


def test_the_summary_says_what_was_lost_and_recovered(chaos_run: ChaosRun) -> None:
    summary = json.loads((chaos_run.run_dir / "summary.json").read_text())
    faults = summary["engine_faults"]
    lost = chaos_run.notes["lost_engine"]
    assert faults["nodes_lost"] == [chaos_run.notes["lost_node"]] and faults["engines_lost_with_node"] == [lost]
    assert faults["replaced"] >= 1 and faults["restored"] >= 2 and faults["not_restarted"] == []
    events = json.loads((chaos_run.run_dir / "engine_events.json").read_text())
    restarts = [e for e in events if e["event"] == "router_restarted"]
    assert faults["router_restarts"] == 1 and "exited" in restarts[0]["why"], restarts  # the kill; the stall waited out
    updates = read_metrics(chaos_run.run_dir / "updates.jsonl")
    assert max(u["rollout/router_restarts"] for u in updates) == 1
    replaced = [e for e in events if e["event"] == "replaced"]
    assert replaced[-1]["engine"] == lost and replaced[-1]["node_id"] == chaos_run.notes["new_node"]
    line = next(x for x in chaos_run.output.splitlines() if x.startswith("engines: "))
    assert line.startswith(f"engines: 1 node(s) lost (engines [{lost}]), "), line
    [restart] = summary["trainer_restarts"]
    assert restart["restart"] == 1 and restart["max_restarts"] == 1 and "trainer rank" in restart["failed"]
    assert "trainer restart 1 of 1" in chaos_run.output


def test_the_trainer_restarts_from_the_save_before_the_kill_at_latest_plus_one(chaos_run: ChaosRun) -> None:
    """Where the run stood at the kill (``notes``) decides the restart: the newest save, the
    versions published after it (they leave the lineage) and the anchor's number."""
    from miles_disagg.weights.store import VersionStore

    notes, output = chaos_run.notes, chaos_run.output
    killed_at, save_step, save_version, latest = (notes["killed_at_step"], notes["save_step"], notes["save_version"],
                                                   notes["latest_at_kill"])
    assert latest > save_version  # the store had moved on after the save
    event = chaos_run.restart_event()
    assert event["failed_at_step"] == killed_at, event
    assert event["resumed_from_step"] == save_step, event
    assert event["discarded_versions"] == [save_version + 1, latest], event
    assert event["version"] == latest + 1  # never a reused number
    assert VersionStore(chaos_run.store_dir).read_index(event["version"]).delta_encoding == "full"
    assert event["groups_dropped"] >= 0
    assert event["restart_s"] > 0
    assert f"trainer failed at step {killed_at}: trainer rank 0 died" in output, output[-6000:]
    assert "(restart 1 of 1)" in output
    assert f"trainer restart 1 of 1: resumed from step {save_step}" in output
    [restart] = json.loads((chaos_run.run_dir / "summary.json").read_text())["trainer_restarts"]
    assert "trainer rank 0 died" in restart["failed"]
    assert restart["failed_at_step"] == killed_at
    assert restart["resumed_from_step"] == save_step
    assert f"trainer restart 1 of 1 at step {killed_at}" in output


def test_steps_after_the_restart_train_on_no_sample_of_the_lost_lineage(chaos_run: ChaosRun) -> None:
    """Versions published after the save are not the restored trainer's: no group generated on
    one is consumed by the steps run again (each step's consumed groups, rewritten by its rerun)."""
    event = chaos_run.restart_event()
    first, last = event["discarded_versions"]
    lost = range(first, last + 1)
    for step in range(event["resumed_from_step"], STEPS):
        groups = [json.loads(line) for line in (chaos_run.run_dir / "consumed" / f"{step}.jsonl").read_text().splitlines()]
        assert groups
        for group in groups:
            assert group["consumed_at_version"] >= event["version"]
            for sample in group["samples"]:
                calls = sample["call_versions"] or [[sample["weight_version_start"], sample["weight_version_end"]]]
                assert not any(v in lost for start, end in calls for v in range(start, end + 1)), (step, calls)
