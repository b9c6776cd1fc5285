"""Engines join and leave a running job through ``miles-disagg engines add|remove|list``.

An ``EngineManager`` in this process (attaching launches no Ray actor) runs one built-in engine
("A") behind its router and serves its control endpoint; a second built-in engine ("B") is started
by hand and joined through the CLI (``cli.main``, so the real argument parsing, the control file,
the admin key and HTTP), while the manager publishes and activates versions. Checked: B is caught
up to the current version, including one activated while it catches up, before the router may
route to it; later updates cover it; ``remove`` drains it (its in-flight requests finish, none
fail) and later updates leave it out; an engine behind ``miles-disagg agent`` (as stock SGLang
would be) joins the same way; every change is in ``membership.jsonl`` and ``placement.json``;
and the CLI's refusals are one line, exit 2, nothing changed.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import httpx
import pytest
import recording_server as recording
from deadlines import scaled
from engine_fixtures import start_engine, stop_engine, wait_until
from rollout_fixtures import VersionSource, long_body

from miles_disagg.net.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, new_key
from miles_disagg.cli import main
from miles_disagg.config.actors import EngineManagerConfig
from miles_disagg.config.components import ClusterConfig, RolloutConfig, WeightUpdateConfig
from miles_disagg.fleet import membership
from miles_disagg.fleet.manager import EngineManager
from miles_disagg.router.client import RouterClient

STORE_AND_LOCAL = ("--weight-store-dir", "--local-checkpoint-dir")


@pytest.fixture(scope="module")
def run(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A running "job": manager + router + engine A (the run's admin key in the environment, as a run sets it)."""
    root = tmp_path_factory.mktemp("membership")
    saved = os.environ.get(ADMIN_API_KEY_ENV)
    os.environ[ADMIN_API_KEY_ENV] = new_key()

    def engine_args(name: str) -> list[str]:
        return [STORE_AND_LOCAL[0], str(root / "store"), STORE_AND_LOCAL[1], str(root / f"local-{name}")]

    engine_a = start_engine(tiny_qwen3_dir, root, *engine_args("a"))
    engine_b = start_engine(tiny_qwen3_dir, root, *engine_args("b"))
    manager = EngineManager(EngineManagerConfig(
        cluster=ClusterConfig(actor_num_gpus_per_node=1),
        rollout=RolloutConfig(rollout_external=True, rollout_external_engine_addrs=[engine_a.url.removeprefix("http://")],
                              rollout_health_check_interval=0.5),
        weights=WeightUpdateConfig(update_weight_transfer_mode="disk-delta", update_weight_disk_dir=str(root / "store")),
        model_path=str(tiny_qwen3_dir), run_dir=str(root / "run")))
    versions = None
    try:
        info = manager.start()
        manager.serve_membership()
        versions = VersionSource(root / "store", tiny_qwen3_dir)
        manager.update_weights(versions.publish_next(seed=1))
        yield {"manager": manager, "a": engine_a, "b": engine_b, "versions": versions, "run_dir": root / "run",
               "store": root / "store", "router_url": info["router_url"]}
    finally:
        if versions is not None:
            versions.close()
        manager.shutdown()
        stop_engine(engine_a)
        stop_engine(engine_b)
        os.environ.pop(ADMIN_API_KEY_ENV) if saved is None else os.environ.update({ADMIN_API_KEY_ENV: saved})


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(["engines", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "membership.jsonl").read_text().splitlines()]


def test_a_joining_engine_is_routed_to_only_once_it_serves_the_current_version(run, capsys, monkeypatch):
    """Version 2 is activated while B catches up to version 1: B is brought to 2 as well before
    the router is told about it; the router never lists it at another version."""
    manager, engine_b, versions = run["manager"], run["b"], run["versions"]
    caught_up_to, seen_at_registration = [], []
    catch_up = manager.members.catch_up

    def catch_up_and_publish_meanwhile(url: str, local_dir: str, version: int) -> int:
        reached = catch_up(url, local_dir, version)
        caught_up_to.append(reached)
        if len(caught_up_to) == 1:  # the rest of the run goes on: a newer version is activated
            manager.update_weights(versions.publish_next(seed=2))
        return reached

    add_worker = manager.router_client.add_worker

    def recording_add_worker(url: str) -> dict:
        seen_at_registration.append((url, engine_b.version(), manager.slots.version))
        return add_worker(url)

    monkeypatch.setattr(manager.members, "catch_up", catch_up_and_publish_meanwhile)
    monkeypatch.setattr(manager.router_client, "add_worker", recording_add_worker)
    code, out, err = cli(capsys, "add", "--run-dir", str(run["run_dir"]), engine_b.url)
    assert code == 0, err
    assert caught_up_to == [1, 2]
    assert seen_at_registration == [(engine_b.url, "2", 2)]
    assert f"joined {engine_b.url} (attached) at version 2" in out
    with RouterClient(run["router_url"]) as router:
        workers = {w["url"]: (w["state"], w["weight_version"]) for w in router.list_workers()}
    assert workers == {run["a"].url: ("ready", 2), engine_b.url: ("ready", 2)}

    manager.update_weights(versions.publish_next(seed=3))  # later updates cover the new member
    assert manager.versions() == ["3", "3"]
    added = [r for r in records(run["run_dir"]) if r["action"] == "add"]
    assert [(r["url"], r["version"], r["kind"]) for r in added] == [(engine_b.url, 2, "attached")]
    assert added[0]["catch_up_s"] > 0 and added[0]["node"] == "127.0.0.1"
    placement = json.loads((run["run_dir"] / "placement.json").read_text())
    assert [e["address"] for e in placement["engines"]] == [run["a"].url, engine_b.url]

    code, out, err = cli(capsys, "list", "--run-dir", str(run["run_dir"]), "--json")
    listed = json.loads(out)
    assert listed["version"] == 3
    assert [(e["url"], e["version"], e["state"]) for e in listed["engines"]] == [
        (run["a"].url, "3", "ready"), (engine_b.url, "3", "ready")]
    code, out, err = cli(capsys, "list", "--run-dir", str(run["run_dir"]))
    assert code == 0 and engine_b.url in out and "STATE" in out.splitlines()[0]


def test_refusals_are_one_line_exit_2_and_change_nothing(run, capsys, tmp_path):
    run_dir = str(run["run_dir"])
    before = run["manager"].members.list()
    cases = [
        (["add", "--run-dir", run_dir, "--admin-api-key", "not-the-key", run["b"].url], "refused the key"),
        (["add", "--run-dir", run_dir, "127.0.0.1:9"], "does not answer /health"),
        (["add", "--run-dir", run_dir, run["router_url"]], "cannot read its server and model info"),
        (["add", "--run-dir", run_dir, run["a"].url], "already an engine of this run"),
        (["remove", "--run-dir", run_dir, "127.0.0.1:9"], "not an engine of this run"),
        (["add", "--run-dir", str(tmp_path), run["b"].url], "no running job in"),
        (["add", "--run-dir", run_dir], "name the engines to attach"),
    ]
    for argv, expected in cases:
        code, out, err = cli(capsys, *argv)
        assert (code, out) == (2, ""), (argv, out, err)
        assert expected in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert run["manager"].members.list() == before
    (tmp_path / "control.json").write_text(json.dumps({"url": "http://127.0.0.1:9"}))
    code, _, err = cli(capsys, "list", "--run-dir", str(tmp_path))
    assert code == 2 and "does not answer: the run has ended" in err and len(err.strip().splitlines()) == 1


def test_an_alias_of_a_member_is_refused_naming_the_member_it_duplicates(run, capsys):
    """Addresses are compared by who answers there (the server's id), not as strings."""
    engine_a = run["a"]
    alias_a = engine_a.url.replace("127.0.0.1", "localhost")
    assert alias_a != engine_a.url
    before = run["manager"].members.list()
    code, out, err = cli(capsys, "add", "--run-dir", str(run["run_dir"]), alias_a)
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    assert f"{alias_a} is already an engine of this run: engine 0 ({engine_a.url}) answers there too" in err
    assert run["manager"].members.list() == before


@pytest.mark.parametrize("answer, hang_s, expected", [
    (recording.not_found, 0.0, "does not answer /health (engine unreachable: not healthy after 1s (/health answered 404))"),
    (recording.empty_objects, 0.0, "does not match this job: architectures: the engine reports neither"),
    (recording.empty_objects, 5.0, "does not answer /health (engine unreachable: not healthy after 1s (ReadTimeout"),
    (recording.wrongly_typed, 0.0, "tp_size: the engine reports 'one' in /server_info, not a number"),
    (recording.key_wanted, 0.0, "answers /server_info with 401: it wants a key before it has shown it is an engine "
                                "of this job"),
], ids=["404", "empty-objects", "hung", "wrongly-typed", "401"])
def test_an_address_that_is_not_an_engine_of_this_job_gets_400_and_never_a_key(run, monkeypatch, answer, hang_s,
                                                                              expected):
    """Through the control endpoint (the run's admin key in the environment; an API key too, where
    the address answers 401: neither is sent): the server records every Authorization it got."""
    monkeypatch.setattr(membership, "ANSWER_TIMEOUT_S", 1.0)
    if answer is recording.key_wanted:
        monkeypatch.setenv(API_KEY_ENV, "the-run-api-key")
    control = json.loads((run["run_dir"] / "control.json").read_text())["url"]
    admin = {"Authorization": f"Bearer {os.environ[ADMIN_API_KEY_ENV]}"}
    before = run["manager"].members.list()
    with recording.recording_server(answer, hang_s=hang_s) as server:
        refused = httpx.post(f"{control}/engines/add", json={"urls": [server.url]}, headers=admin, timeout=60,
                             trust_env=False)
        assert refused.status_code == 400, refused.text
        assert expected in refused.json()["message"], refused.json()["message"]
        assert server.requests and server.authorizations == [], server.requests
    if answer is recording.key_wanted:
        assert "--rollout-api-key-before-vetting" in refused.json()["message"]
        assert [path for _, path, _ in server.requests] == ["/health", "/server_info"], server.requests
    if answer is recording.wrongly_typed:
        for field in ("dtype: the engine reports 5", "context_length: the engine reports []",
                      "architectures: the engine reports 5", "weight_store_dirs is not a list of paths"):
            assert field in refused.json()["message"], field
    assert run["manager"].members.list() == before


def test_an_address_with_credentials_gets_400_and_nothing_is_sent(run):
    control = json.loads((run["run_dir"] / "control.json").read_text())["url"]
    admin = {"Authorization": f"Bearer {os.environ[ADMIN_API_KEY_ENV]}"}
    with recording.recording_server(recording.empty_objects) as server:
        address = server.url.replace("http://", "http://user:secret@")
        refused = httpx.post(f"{control}/engines/add", json={"urls": [address]}, headers=admin, trust_env=False)
        assert refused.status_code == 400 and "carries no user or password" in refused.json()["message"]
        assert "secret" not in refused.text and server.requests == []


def test_the_control_endpoint_takes_only_the_admin_key_and_bounded_bodies(run):
    control = json.loads((run["run_dir"] / "control.json").read_text())["url"]
    assert oct((run["run_dir"] / "control.key").stat().st_mode & 0o777) == "0o600"
    key = os.environ[ADMIN_API_KEY_ENV]
    assert httpx.get(f"{control}/engines", trust_env=False).status_code == 401
    big = httpx.post(f"{control}/engines/add", content=b"x" * (1 << 20), trust_env=False,
                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    assert big.status_code == 413
    wrong = httpx.post(f"{control}/engines/remove", json={"urls": "not-a-list"}, trust_env=False,
                       headers={"Authorization": f"Bearer {key}"})
    assert wrong.status_code == 400 and "urls" in wrong.json()["message"]


def test_remove_drains_in_flight_requests_then_later_updates_leave_the_engine_out(run, capsys):
    manager, engine_b, versions = run["manager"], run["b"], run["versions"]
    answers: list[int] = []

    def generate(seed: int) -> None:
        with httpx.Client(base_url=run["router_url"], timeout=scaled(120), trust_env=False) as http:
            answers.append(http.post("/generate", json=long_body(300, seed=seed)).status_code)

    senders = [threading.Thread(target=generate, args=(seed,)) for seed in range(4)]
    for sender in senders:
        sender.start()
    with RouterClient(run["router_url"]) as router:
        wait_until(lambda: router.worker(engine_b.url)["outstanding"] > 0, timeout=scaled(60),
                   what="a request in flight on B")
        code, out, err = cli(capsys, "remove", "--run-dir", str(run["run_dir"]), "--json", engine_b.url)
        assert code == 0, err
        [removed] = json.loads(out)["removed"]
        assert (removed["url"], removed["kind"], removed["drained"]) == (engine_b.url, "attached", True)
        assert [w["url"] for w in router.list_workers()] == [run["a"].url]
    for sender in senders:
        sender.join(timeout=scaled(120))
    assert answers == [200, 200, 200, 200]  # none lost: B's own finished before it left
    assert engine_b.get("/health").status_code == 200, "an attached engine is left running"

    manager.update_weights(versions.publish_next(seed=4))
    assert manager.versions() == ["4"] and engine_b.version() == "3"
    assert [r["action"] for r in records(run["run_dir"])] == ["start", "add", "remove"]
    placement = json.loads((run["run_dir"] / "placement.json").read_text())
    assert [e["address"] for e in placement["engines"]] == [run["a"].url]

    code, _, err = cli(capsys, "remove", "--run-dir", str(run["run_dir"]), run["a"].url)
    assert code == 2 and "no live engine" in err and "--force" in err
    assert [r["action"] for r in records(run["run_dir"])] == ["start", "add", "remove"]


def test_an_engine_behind_the_agent_joins_as_stock_sglang_would(run, capsys, tiny_qwen3_dir, tmp_path):
    """The built-in engine stands in for stock SGLang (its own /pull_weights unused): the agent in
    front of it is what joins; the agent materializes the versions in its local checkpoint."""
    from miles_disagg.engines.launch import launch_agent

    manager, versions = run["manager"], run["versions"]
    local = tmp_path / "local" / "ckpt"
    local.parent.mkdir(parents=True)
    # its server info passes through the agent: it names the run's store as a built-in engine must
    engine = start_engine(tiny_qwen3_dir, tmp_path, "--local-checkpoint-dir", str(local),
                          "--weight-store-dir", str(run["store"]))
    agent = launch_agent(engine.url, local, log_path=tmp_path / "agent.log", store_dirs=[run["store"]])
    try:
        code, out, err = cli(capsys, "add", "--run-dir", str(run["run_dir"]), "--json", agent.url)
        assert code == 0, err
        [joined] = json.loads(out)["joined"]
        assert (joined["url"], joined["version"]) == (agent.url, manager.slots.version)
        assert engine.version() == str(manager.slots.version)
        manager.update_weights(versions.publish_next(seed=5))
        assert manager.versions() == [str(manager.slots.version)] * 2
        assert manager.local_dirs[-1] == str(local)  # the agent's own checkpoint, as it reports it
    finally:
        agent.stop()
        stop_engine(engine)


def test_removing_the_last_engine_makes_rollout_wait_until_one_joins(run, capsys, monkeypatch):
    """``engines remove --force`` of every engine: a rollout request waits (the router's 503
    NoWorkerAvailable is not one of the refusals a request may use up: with 3 allowed it would have
    failed long before), the capacity policy counts the time with no engine (so
    ``--min-rollout-engines-timeout`` bounds the wait: it ends the run, the rollout does not), and
    the request is served once an engine joins; the post-write hooks' engine list follows."""
    import asyncio

    from engine_fixtures import Background

    from miles_disagg.rollout import generate

    manager, engine_b = run["manager"], run["b"]
    monkeypatch.setattr(generate, "MAX_ATTEMPTS", 3)
    members = manager.member_urls()
    code, out, err = cli(capsys, "remove", "--run-dir", str(run["run_dir"]), "--force", *members)
    assert code == 0, err
    assert manager.member_urls() == []

    async def one_request() -> dict:
        async with httpx.AsyncClient(timeout=scaled(120), trust_env=False) as client:
            return await generate.generate_one(client, run["router_url"], long_body(4, seed=11), {})

    request = Background(lambda: asyncio.run(one_request()))
    with RouterClient(run["router_url"]) as router:
        wait_until(lambda: router.metrics()["no_worker_available"] >= 6, timeout=scaled(60),
                   what="the request refused more often than it may be refused otherwise")
    assert not request.done(), "the rollout request gave up while no engine served"
    capacity = manager.capacity()
    assert (capacity["live"], capacity["total"], capacity["verdict"]) == (0, 0, None) and capacity["below_for_s"] > 0

    alias_b = engine_b.url.replace("127.0.0.1", "localhost")  # one server named twice in one request
    code, _, err = cli(capsys, "add", "--run-dir", str(run["run_dir"]), engine_b.url, alias_b)
    assert code == 2 and f"{alias_b} and {engine_b.url} are one server under two addresses" in err, err
    code, out, err = cli(capsys, "add", "--run-dir", str(run["run_dir"]), engine_b.url)
    assert code == 0, err
    answer = request.result(timeout=scaled(120))
    assert answer["meta_info"]["weight_version"] == str(manager.slots.version)
    assert manager.member_urls() == [engine_b.url] and manager.capacity()["live"] == 1


def test_a_stalled_router_delays_an_update_and_a_killed_one_is_started_again(run):
    """The router SIGSTOPped for 15 s while an update tells it an engine pauses: the update waits and
    then finishes (no restart: it answered within the bound). SIGKILLed: it is started again at its
    address (the monitor's check, or the update's first call, whichever comes first), registered from
    the run's record, and the update finishes on it; counted in the update's metrics and the events."""
    import signal

    from engine_fixtures import Background

    manager, versions = run["manager"], run["versions"]
    members, pid = manager.member_urls(), manager.router.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        update = Background(lambda: manager.update_weights(versions.publish_next(seed=6)))
        assert not threading.Event().wait(15.0) and not update.done(), "an update went through a stopped router"
    finally:
        os.kill(pid, signal.SIGCONT)
    metrics = update.result(timeout=scaled(120))
    assert metrics["rollout/router_restarts"] == 0 and manager.router.proc.pid == pid
    assert manager.versions() == [str(manager.slots.version)] * len(members)

    manager.router.proc.kill()
    metrics = manager.update_weights(versions.publish_next(seed=7))
    assert metrics["rollout/router_restarts"] == 1 and manager.router.proc.pid != pid
    with RouterClient(run["router_url"]) as router:  # the rollout's address serves again
        assert {(w["url"], w["state"], w["weight_version"]) for w in router.list_workers()} == {
            (url, "ready", manager.slots.version) for url in members}
    [restart] = [e for e in manager.events if e["event"] == "router_restarted"]
    assert restart["workers"] == members and "exited" in restart["why"], restart


def test_an_update_whose_router_calls_failed_is_made_again_not_left_half_applied(run, monkeypatch):
    """The router call marking an engine ready again fails for good (after the keeper's retries and
    restart: simulated here) once: the update is made again, the engine already at the version is only
    marked ready, and the update returns with every engine at the version and routed."""
    from miles_disagg.router.client import RouterUnreachable

    manager, versions = run["manager"], run["versions"]
    keeper, real_call = manager.routing.keeper, manager.routing.keeper.call
    failed: list[str] = []

    def failing_once(what: str, fn):
        if what.startswith("set_worker_state") and what.endswith(" ready") and not failed:
            failed.append(what)
            raise RouterUnreachable(f"{what}: the router did not answer, also after it was restarted")
        return real_call(what, fn)

    monkeypatch.setattr(keeper, "call", failing_once)
    version = versions.publish_next(seed=8)
    manager.update_weights(version)
    assert failed and manager.slots.version == version
    with RouterClient(run["router_url"]) as router:
        assert {(w["state"], w["weight_version"]) for w in router.list_workers()} == {("ready", version)}
    assert set(manager.versions()) == {str(version)}
