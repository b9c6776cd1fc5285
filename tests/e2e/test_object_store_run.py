"""A whole ``train_async.py`` run with its version store on a real S3-API server (moto, a child process)
and two engines in two regions that share no path with the trainer or each other: each engine has
its own local checkpoint, fetches the base (version 0) from the store, and pulls every version
through its region's ``miles-disagg relay``. Mid-run the eu relay is killed; the run goes on with
direct pulls for that region (counted), trains, and every consumed sample is attributed to the
version whose weights recompute its logprobs. Each update records the WAN bytes per region: with the
relay, one copy of the version; and the relay's own record says it pulled each object once. After
two updates a third engine, started by hand on a node of its own (its base fetched with ``weights
fetch-base``), joins by ``engines add`` and catches up from the store alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from unittest import mock
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from attribution import count_misattributed, samples_by_version
from deadlines import scaled
from run_waits import wait_while_running
from s3_fixtures import s3_server  # noqa: F401 - fixture
from scoring_gate import GATE_ENV, allow

from miles_disagg.net.process import free_port
from miles_disagg.tracking import read_records
from miles_disagg.weights.stores import open_store

pytestmark = [pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
STEPS, BATCH, SAMPLES = 6, 8, 4
REGIONS = ("us", "eu")
HAND_REGION = "ap"  # the engine started by hand and added mid-run: one engine, no relay
RUN_TIMEOUT_S = 300


@dataclass
class ObjectStoreRun:
    root: Path
    url: str
    env: dict
    relays: dict = field(default_factory=dict)  # region -> (process, url)
    relay_info: dict = field(default_factory=dict)
    joined: dict = field(default_factory=dict)  # `engines add` of the engine started by hand
    returncode: int | None = None
    output: str = ""

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def start_relay(self, region: str) -> None:
        port = free_port("127.0.0.1")
        proc = subprocess.Popen([sys.executable, "-m", "miles_disagg.cli", "relay", "--store", self.url, "--cache-dir",
                                 str(self.root / f"relay-{region}"), "--port", str(port), "--region", region],
                                env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert "listening" in proc.stdout.readline()
        self.relays[region] = (proc, f"http://127.0.0.1:{port}")

    def updates(self) -> list[dict]:
        return read_records(self.run_dir / "updates.jsonl")


@pytest.fixture(scope="module")
def object_store_run(s3_server, digits_base_model, tmp_path_factory) -> ObjectStoreRun:
    root = tmp_path_factory.mktemp("object-store-run")
    bucket = s3_server.create_bucket("e2e-object-store-run")
    gate = root / "gate"
    run = ObjectStoreRun(root, f"s3://{bucket}/run", {**os.environ, **s3_server.env(), GATE_ENV: str(gate),
                                                        "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}"
                                                                      f"{os.environ.get('PYTHONPATH', '')}"})
    base = shutil.copytree(digits_base_model, root / "trainer-base")  # the trainer's own copy: engines never see it
    for region in REGIONS:
        run.start_relay(region)
    allow(gate, 3 * BATCH * SAMPLES)
    cmd = [sys.executable, "train_async.py", "--config", "configs/tiny_cpu.yaml", "--run-dir", str(run.run_dir),
           "--hf-checkpoint", str(base), "--num-rollout", str(STEPS), "--rollout-batch-size", str(BATCH),
           "--n-samples-per-prompt", str(SAMPLES), "--global-batch-size", str(BATCH * SAMPLES),
           "--update-weight-disk-dir", run.url, "--rollout-base-from-store", "--rollout-engine-regions", *REGIONS,
           "--update-weight-relay", *(f"{r}={run.relays[r][1]}" for r in REGIONS),
           "--custom-rm-path", "scoring_gate.reward",
           "--save-debug-rollout-data", str(run.run_dir / "consumed" / "{rollout_id}.jsonl")]
    log = root / "run.log"
    hand_engine = None
    with open(log, "w") as out:
        driver = subprocess.Popen(cmd, cwd=REPO, env=run.env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_while_running(lambda: len(run.updates()) >= 2, driver, log, scaled(RUN_TIMEOUT_S), "two updates")
            hand_engine, run.joined = _add_engine_by_hand(run)
            eu_relay = run.relays["eu"][0]
            eu_relay.kill()  # mid-run: the eu engine must fall back to the store
            eu_relay.wait(scaled(30))
            gate.unlink()
            run.returncode = driver.wait(scaled(RUN_TIMEOUT_S))
        finally:
            gate.unlink(missing_ok=True)
            if driver.poll() is None:
                driver.kill()
            if hand_engine is not None:
                hand_engine.stop()
            run.relay_info = _relay_info(run)
            for proc, _ in run.relays.values():
                proc.kill()
    run.output = log.read_text()
    return run


def _add_engine_by_hand(run: ObjectStoreRun):
    """An engine its user starts on a node of its own (region ap, no relay, nothing shared): the base
    fetched from the store by hand, then ``engines add``. Returns the engine and its join record."""
    from miles_disagg.engines.launch import launch_engine

    def cli(*argv: str) -> dict:
        result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", *argv], env=run.env, capture_output=True,
                                text=True, timeout=scaled(300))
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout)

    cli("weights", "fetch-base", "--store", run.url, "--dest", str(run.root / "hand-base"))
    with mock.patch.dict(os.environ, {k: v for k, v in run.env.items() if k.startswith("AWS_")}):
        engine = launch_engine(run.root / "hand-base", log_path=run.root / "hand-engine.log",
                               extra_args=["--weight-store-dir", run.url, "--region", HAND_REGION,
                                           "--local-checkpoint-dir", str(run.root / "hand-local")])
    try:
        [joined] = cli("engines", "add", "--json", "--run-dir", str(run.run_dir), engine.url)["joined"]
    except BaseException:
        engine.stop()
        raise
    return engine, joined


def _relay_info(run: ObjectStoreRun) -> dict:
    proc, url = run.relays["us"]
    if proc.poll() is not None:
        return {}
    return httpx.get(f"{url}/relay_info", timeout=30, trust_env=False).json()


def test_the_run_trains_on_an_object_store_across_two_regions(object_store_run: ObjectStoreRun):
    run = object_store_run
    assert run.returncode == 0, run.output[-4000:]
    summary = json.loads((run.run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS, summary
    for index in range(2):  # each engine's own node-local base, fetched from the store
        assert (run.run_dir / "rollout-checkpoints" / f"engine-{index}.base" / "config.json").is_file()
    assert run.joined["version"] >= 1, run.joined  # the engine added by hand caught up from the store alone


def speak_to_the_store(run: ObjectStoreRun, monkeypatch) -> None:
    for name, value in run.env.items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)


def test_every_update_records_one_wan_copy_per_region_and_the_dead_relay_as_fallbacks(object_store_run, monkeypatch):
    run = object_store_run
    speak_to_the_store(run, monkeypatch)
    store = open_store(run.url, cache_dir=run.root / "reader")
    updates = run.updates()
    assert [u["weights/version"] for u in updates] == list(range(1, STEPS + 1))
    for update in updates:
        size = _version_bytes(store, update["weights/version"])
        for region in REGIONS:
            assert update[f"weights/wan_bytes/{region}"] == size, (region, update)  # 1.0x the version, not 1x per engine
    joined_later = [u for u in updates if u["weights/version"] > run.joined["version"]]
    assert joined_later and all(u[f"weights/wan_bytes/{HAND_REGION}"] == _version_bytes(store, u["weights/version"])
                                for u in joined_later)
    assert sum(u["weights/relay_fallbacks"] for u in updates[2:]) >= STEPS - 2  # the eu engine after its relay died
    assert run.relay_info["num_hits"] == 0 and run.relay_info["num_pulls"] >= 2 * STEPS  # each object pulled once
    assert sorted(map(int, run.relay_info["wan_bytes_by_version"])) == list(range(0, STEPS + 1))  # the base too


def _version_bytes(store, version: int) -> int:
    """What a pull of ``version`` moves: its manifest and its payload objects."""
    manifest = store.read_pointer().manifests[version]
    return manifest.nbytes + store.payload_bytes(store.read_index(version))


def test_no_sample_is_misattributed(object_store_run: ObjectStoreRun, digits_base_model: Path, tmp_path: Path,
                                    monkeypatch):
    run = object_store_run
    speak_to_the_store(run, monkeypatch)
    by_version = samples_by_version(run.run_dir / "consumed", STEPS)
    misattributed, checked = count_misattributed(by_version, lambda version: run.url, digits_base_model,
                                                 tmp_path / "local")
    assert checked >= STEPS * BATCH * SAMPLES * 0.8 and misattributed == 0, (checked, misattributed)
