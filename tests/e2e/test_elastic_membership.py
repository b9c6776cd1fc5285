"""Elastic membership in a whole run: an engine started by hand joins a running ``train_async.py``
job through ``miles-disagg engines add`` and serves the run's versions from the next update on;
``miles-disagg engines remove`` then drains the engine the run started with, and the run finishes
on the joined one with no sample lost. Both changes are in ``placement.json`` and ``membership.jsonl``.

The CLI reaches the job the way a user does: the run directory's ``control.json`` and the admin key
the run generated (``control.key``). One attached engine to start with keeps the run small. A
scoring gate (``scoring_gate.py``) paces the run, so it cannot reach its last step before the test
has joined one engine and removed the other (unpaced, a tiny run's steps took a third of a second
and a loaded machine's CLI call lost that race).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from base_model import place_base_model
from deadlines import scaled
from run_waits import wait_while_running
from scoring_gate import GATE_ENV, allow

from miles_disagg.tracking import read_metrics

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
STEPS = 12
STEP_SAMPLES = 4 * 8  # --rollout-batch-size 4, the config's 8 samples per prompt


def lines(path: Path) -> list[dict]:
    return read_metrics(path) if path.exists() else []


def paced(predicate, gate: Path, updates: Path):
    """``predicate``, letting one more step's samples be scored whenever the run has logged no update
    for a while (held at the gate: groups it dropped as stale used up their share)."""
    seen, since = len(lines(updates)), time.monotonic()

    def check() -> bool:
        nonlocal seen, since
        if predicate():
            return True
        if len(lines(updates)) != seen:
            seen, since = len(lines(updates)), time.monotonic()
        elif time.monotonic() - since > scaled(3):
            allow(gate, STEP_SAMPLES)
            since = time.monotonic()
        return False

    return check


def engines_cli(action: str, *argv: str) -> dict:
    """``miles-disagg engines ACTION --json ARGV...`` (the addresses last); its JSON answer."""
    result = subprocess.run([sys.executable, "-m", "miles_disagg.cli", "engines", action, "--json", *argv],
                            capture_output=True, text=True, timeout=scaled(300))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_an_engine_joins_a_running_job_and_another_is_drained_out(tmp_path: Path, digits_base_model: Path) -> None:
    from miles_disagg.engines.launch import launch_engine

    base = place_base_model(digits_base_model, tmp_path)
    run_dir = tmp_path / "run"
    engines = [launch_engine(base, log_path=tmp_path / f"engine-{name}.log",
                             extra_args=["--weight-store-dir", str(run_dir / "weight-updates"),
                                         "--local-checkpoint-dir", str(tmp_path / f"engine-local-{name}")])
               for name in ("started-with", "joining")]
    first, joining = engines
    gate = tmp_path / "gate"
    allow(gate, 2 * STEP_SAMPLES)  # two steps, then the run waits for the test
    env = {**os.environ, "MILES_DISAGG_RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp"),
           "RAY_AUTH_MODE": "disabled", GATE_ENV: str(gate),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
    log = tmp_path / "run.log"
    with log.open("w") as out:
        run = subprocess.Popen(
            [sys.executable, str(REPO / "train_async.py"), "--config", str(REPO / "configs/tiny_cpu.yaml"),
             "--hf-checkpoint", str(base), "--run-dir", str(run_dir), "--num-rollout", str(STEPS),
             "--rollout-batch-size", "4", "--global-batch-size", "32", "--rollout-external",
             "--rollout-external-engine-addrs", first.url.removeprefix("http://"), "--max-weight-staleness", "1",
             "--custom-rm-path", "scoring_gate.reward"],
            cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        updates = run_dir / "updates.jsonl"
        wait_while_running(lambda: (run_dir / "control.json").exists() and len(lines(updates)) >= 1, run, log,
                           scaled(300), "first update")
        [joined] = engines_cli("add", "--run-dir", str(run_dir), joining.url)["joined"]
        print(f"join catch-up: {joined['catch_up_s']:.2f}s to version {joined['version']}")
        assert joined["url"] == joining.url and joined["version"] >= 1

        following = str(joined["version"] + 1)

        def next_update() -> dict | None:
            found = [u for u in lines(updates) if following in u["weights/engine_versions"]]
            return found[0] if found else None

        allow(gate, 2 * STEP_SAMPLES)
        wait_while_running(paced(lambda: next_update() is not None, gate, updates), run, log, scaled(300),
                           "the update after the join")
        assert next_update()["weights/engine_versions"] == [following, following]  # both serve it: within one update

        [removed] = engines_cli("remove", "--run-dir", str(run_dir), first.url)["removed"]
        assert (removed["url"], removed["kind"], removed["drained"]) == (first.url, "attached", True)
        gate.unlink()  # the membership changes are done: the run goes to its end
        assert run.wait(timeout=scaled(400)) == 0, log.read_text()[-6000:]
    finally:
        if run.poll() is None:
            run.kill()
        for engine in engines:
            engine.stop()

    records = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(STEPS))  # every step recorded once
    assert sum(r.get("rollout/lost_groups", 0) for r in records) == 0
    members = [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines()]
    assert [(m["action"], m["url"]) for m in members] == [("start", first.url), ("add", joining.url),
                                                          ("remove", first.url)]
    after = [u["weights/engine_versions"] for u in lines(run_dir / "updates.jsonl")
             if max(int(v) for v in u["weights/engine_versions"]) > members[-1]["version"]]
    assert after and all(versions == [versions[0]] for versions in after)  # the joined engine alone
    assert after[-1] == [str(STEPS)]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [e["address"] for e in placement["engines"]] == [joining.url]
    assert not (run_dir / "control.json").exists() and not (run_dir / "control.key").exists()
