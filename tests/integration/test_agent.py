"""``miles-disagg agent`` in front of an engine treated as stock SGLang (its own /pull_weights unused).

Versions are published with ``DeltaPublisher``; the agent materializes them on the host,
``/update_weights_from_disk`` through the agent loads the slot holding exactly that
version (or ``/activate_weights`` does the whole activation on the agent's side), and
everything else is proxied to the engine unchanged. The engine is the
built-in one (launched as a subprocess) so tests can also read its internal state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from deadlines import scaled
import torch

from engine_fixtures import ENGINE_URL_ENV, Background, greedy_reference, sse_events, start_engine, stop_engine, wait_until
from miles_disagg.engines.launch import launch_agent
from miles_disagg.engines.launch import free_port
from miles_disagg.engines.check import EngineExpectation, check_engine_matches
from miles_disagg.types import version_dirname

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(bool(os.environ.get(ENGINE_URL_ENV)), reason="drives the built-in engine"),
]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]
REFUSED_PULL_TYPES = {"ChecksumMismatch", "FormatError", "LayoutMismatch"}


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


class World:
    """A model dir, a store, an engine, and an agent in front of it with its own local checkpoint."""

    def __init__(self, root: Path, base: Path):
        from miles_disagg.weights.publisher import DeltaPublisher

        self.root = root
        self.model_dir = root / "model"
        shutil.copytree(base, self.model_dir)
        self.store = root / "store"
        self.local = root / "local" / "ckpt"
        self.local.parent.mkdir(parents=True)
        self.publisher = DeltaPublisher(self.store, base_dir=self.model_dir)
        self.publisher.capture_baseline()
        self.tensors = _load(self.model_dir)
        # the engine stands in for stock SGLang; its roots let it load the agent's slots
        self.engine = start_engine(self.model_dir, root, "--local-checkpoint-dir", str(self.local))
        self.agent_proc = launch_agent(self.engine.url, self.local, log_path=root / "agent.log", store_dirs=[self.store])
        self.agent = httpx.Client(base_url=self.agent_proc.url, timeout=120.0)

    def close(self) -> None:
        self.agent.close()
        self.agent_proc.stop()
        stop_engine(self.engine)
        self.publisher.close()

    def publish(self, names: list[str], seed: int) -> int:
        generator = torch.Generator().manual_seed(seed)
        for name in names:
            t = self.tensors[name]
            self.tensors[name] = t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        return self.publisher.publish((name, self.tensors[name]) for name in names).ref.version

    def pull(self, version: int, **extra) -> httpx.Response:
        return self.agent.post("/pull_weights", json={"target_version": version, "source_dir": str(self.store), **extra})

    def activate(self, version: int | str) -> httpx.Response:
        return self.agent.post("/update_weights_from_disk",
                               json={"model_path": str(self.local), "weight_version": str(version)})

    def greedy(self, client: httpx.Client | None = None) -> list[int]:
        response = (client or self.agent).post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY})
        assert response.status_code == 200, response.text
        return response.json()["output_ids"]

    def version(self) -> str:
        return self.agent.get("/get_weight_version").json()["weight_version"]

    def info(self) -> dict:
        return self.agent.get("/agent_info").json()


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir, tmp_path_factory):
    w = World(tmp_path_factory.mktemp("agent"), tiny_qwen3_dir)
    yield w
    w.close()


def test_proxy_passes_the_engine_api_through(world):
    direct = world.engine.client
    assert world.agent.get("/health").status_code == 200
    assert world.agent.get("/get_model_info").json() == direct.get("/get_model_info").json()
    assert world.greedy() == world.greedy(direct)
    streamed = world.agent.post("/generate", json={"input_ids": PROMPT, "sampling_params": GREEDY, "stream": True})
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    events = sse_events(streamed)
    assert events[-1] == "[DONE]" and events[-2]["output_ids"] == world.greedy(direct)
    for method, path, body in (("POST", "/generate", {"input_ids": "x"}), ("GET", "/no_such_route", None)):
        via_agent = world.agent.request(method, path, json=body)
        straight = direct.request(method, path, json=body)
        assert via_agent.status_code == straight.status_code >= 400
        assert via_agent.json() == straight.json()
        assert via_agent.headers["content-type"] == straight.headers["content-type"]


def test_pull_pause_activate_continue_serves_the_published_policy(world):
    before = world.greedy()
    assert world.publish(sorted(world.tensors), seed=1) == 1
    expected_v1 = dict(world.tensors)
    assert world.publish(["model.layers.0.mlp.down_proj.weight", "lm_head.weight"], seed=2) == 2

    pulled = world.pull(1)
    assert pulled.status_code == 200, pulled.text
    body = pulled.json()
    assert body["success"] is True and body["version"] == 1
    slot = Path(body["path"])
    assert slot.is_dir() and not slot.is_symlink() and slot != world.local
    assert world.version() == "0" and world.greedy() == before  # prepared while serving, not live
    assert world.engine.internal_state()["staged_version"] is None  # the engine's own /pull_weights unused

    assert world.agent.post("/pause_generation", json={"mode": "retract"}).status_code == 200
    activated = world.activate(1)
    assert world.agent.post("/continue_generation", json={}).status_code == 200
    assert activated.status_code == 200, activated.text
    assert activated.json()["success"] is True and activated.json()["loaded_path"] == str(slot)
    assert activated.json()["activation"] == "disk"  # the engine loaded a directory, as stock SGLang would

    assert world.version() == "1"
    assert world.engine.internal_state()["weights_path"] == str(slot)
    output = world.greedy()
    assert output != before
    assert output == greedy_reference(world.model_dir, expected_v1, PROMPT, GREEDY["max_new_tokens"])
    assert output == greedy_reference(world.model_dir, _load(slot), PROMPT, GREEDY["max_new_tokens"])
    assert world.info()["held"]["version"] == 1


def test_an_unprepared_version_is_refused_and_the_engine_is_untouched(world):
    output = world.greedy()
    refused = world.activate(2)  # published, not pulled
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["success"] is False and error["error"]["type"] == "VersionNotPrepared"
    assert "weight_version 2" in error["message"] and "holds version 1" in error["message"]
    assert world.version() == "1" and world.greedy() == output


def test_the_next_version_lands_in_the_other_slot(world):
    first_slot = Path(world.info()["held"]["path"])
    pulled = world.pull(2)
    assert pulled.status_code == 200, pulled.text
    assert pulled.json()["num_changed_tensors"] == 2 and pulled.json()["previous_version"] == 1
    second_slot = Path(pulled.json()["path"])
    assert second_slot != first_slot and second_slot.parent == first_slot.parent
    assert world.activate(2).status_code == 200
    assert world.version() == "2"
    assert world.greedy() == greedy_reference(world.model_dir, world.tensors, PROMPT, GREEDY["max_new_tokens"])
    stale = world.activate(1)  # no longer held: its slot is the next pull's scratch
    assert stale.status_code == 400 and "holds version 2" in stale.json()["message"]
    assert world.version() == "2"


def test_one_call_activation_through_the_agent(world):
    """``/activate_weights``: the agent pauses its engine, flushes, loads the held slot, continues and
    checks the version itself, and records the load as a proxied one."""
    version = world.publish(["model.layers.0.self_attn.o_proj.weight"], seed=4)
    pulled = world.pull(version)
    assert pulled.status_code == 200 and pulled.json()["miles_disagg"] == {"activate_weights": True}, pulled.text
    assert world.info()["activate_weights"] is True
    slot = Path(pulled.json()["path"])
    answer = world.agent.post("/activate_weights", json={"weight_version": str(version), "pause_mode": "retract"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["success"] is True and body["weight_version"] == str(version) and body["loaded_path"] == str(slot)
    assert body["load"]["activation"] == "disk" and body["pause_ms"] >= 0
    assert world.version() == str(version)
    state = world.engine.internal_state()
    assert state["paused_mode"] is None and state["weights_path"] == str(slot)
    info = world.info()
    assert info["last_activation"]["version"] == version and info["last_activation"]["path"] == str(slot)
    assert info["last_activation"]["engine_status"] == 200 and info["last_activation"]["error"] is None
    assert info["num_activations_in_flight"] == 0
    assert world.greedy() == greedy_reference(world.model_dir, world.tensors, PROMPT, GREEDY["max_new_tokens"])


@pytest.mark.parametrize("body, status, kind", [
    ({"weight_version": "99"}, 400, "VersionNotPrepared"),
    ({"weight_version": "x"}, 400, "InvalidInput"),
    ({"weight_version": "1", "pause_mode": "sideways"}, 400, "InvalidInput"),
    ({"weight_version": "3", "model_path": "/elsewhere"}, 403, "OutsideRoots"),
])
def test_a_one_call_activation_the_agent_cannot_serve_is_refused_before_any_pause(world, body, status, kind):
    output, version = world.greedy(), world.version()
    refused = world.agent.post("/activate_weights", json=body)
    assert refused.status_code == status and refused.json()["error"]["type"] == kind, refused.text
    assert world.version() == version and world.greedy() == output
    assert world.engine.internal_state()["paused_mode"] is None


def test_a_load_the_engine_refuses_fails_the_one_call_and_the_engine_is_continued(world):
    """The held slot's payload cut short: the engine refuses the load after the pause began (503, as the
    per-step sequence's ActivationFailed); the engine is continued and keeps its version."""
    output, version = world.greedy(), world.version()
    held = world.info()["held"]
    payload = sorted(Path(held["path"]).glob("*.safetensors"))[0]
    kept = payload.with_name(payload.name + ".kept")
    payload.rename(kept)  # a new file in its place: a hard link elsewhere keeps the real bytes
    try:
        payload.write_bytes(kept.read_bytes()[:64])
        failed = world.agent.post("/activate_weights", json={"weight_version": str(held["version"])})
    finally:
        payload.unlink()
        kept.rename(payload)
    assert failed.status_code == 503, failed.text
    body = failed.json()
    assert body["success"] is False and body["error"]["type"] == "ActivationFailed"
    assert body["message"].startswith(f"activation of v{held['version']} failed: EngineRefused: ")
    assert "/update_weights_from_disk answered 400" in body["message"]
    assert world.engine.internal_state()["paused_mode"] is None
    assert world.version() == version and world.greedy() == output
    info = world.info()
    assert info["last_activation"]["engine_status"] == 400 and "activation of version" in info["last_error"]
    assert info["num_activations_in_flight"] == 0


def _flip_a_payload_byte(version_dir: Path) -> None:
    """Flip one byte in the middle of the first tensor's compressed payload."""
    payload = sorted(version_dir.glob("*.safetensors"))[0]
    raw = bytearray(payload.read_bytes())
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    start, end = next(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    raw[8 + length + (start + end) // 2] ^= 0xFF
    payload.write_bytes(bytes(raw))


def test_a_corrupted_delta_fails_the_pull_and_changes_nothing(world):
    output, version = world.greedy(), world.version()
    held = world.info()["held"]["version"]
    good = dict(world.tensors)
    bad = world.publish(["model.layers.1.self_attn.q_proj.weight"], seed=3)
    _flip_a_payload_byte(world.store / version_dirname(bad))
    pulled = world.pull(bad)
    assert 400 <= pulled.status_code < 500, pulled.text
    error = pulled.json()
    assert error["success"] is False and error["error"]["type"] in REFUSED_PULL_TYPES, error
    assert "model.layers.1.self_attn.q_proj.weight" in error["message"]
    assert world.version() == version and world.greedy() == output
    info = world.info()
    assert info["held"]["version"] == held and f"pull of version {bad} failed" in info["last_error"]
    refused = world.activate(bad)
    assert refused.status_code == 400 and world.version() == version
    world.tensors = good


def test_pull_refuses_another_local_checkpoint_dir(world):
    other = world.root / "elsewhere"
    refused = world.pull(1, local_checkpoint_dir=str(other))
    assert refused.status_code == 403  # outside the agent's roots
    assert str(other) in refused.json()["message"] and str(world.local) in refused.json()["message"]
    assert not other.exists()


def test_attach_check_against_the_live_engine(world):
    server_info = world.agent.get("/get_server_info").json()
    model_info = world.agent.get("/get_model_info").json()
    match = EngineExpectation.from_hf_checkpoint(world.model_dir, tp_size=1)
    assert check_engine_matches(match, server_info, model_info) == []
    problems = check_engine_matches(EngineExpectation.from_hf_checkpoint(world.model_dir, tp_size=2),
                                    server_info, model_info)
    assert problems == ["tp_size: the engine runs tp_size=1, --rollout-num-gpus-per-engine is 2"]


HOOK_MODULE = """
import os, time

def block(source_dir, target_version):
    open(os.environ["AGENT_HOOK_ENTERED"], "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["AGENT_HOOK_RELEASE"]):
        if time.monotonic() > deadline:
            raise RuntimeError("the test never released the hook")
        time.sleep(0.01)
"""


def test_the_engine_keeps_serving_through_the_agent_during_a_pull(world, tmp_path, monkeypatch):
    """A second agent whose pre-read hook blocks until released: its proxy must not wait for the pull."""
    (tmp_path / "agent_hooks.py").write_text(HOOK_MODULE)
    entered, release = tmp_path / "entered", tmp_path / "release"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("AGENT_HOOK_ENTERED", str(entered))
    monkeypatch.setenv("AGENT_HOOK_RELEASE", str(release))
    proc = launch_agent(world.engine.url, tmp_path / "ckpt", log_path=tmp_path / "agent.log",
                        base_dir=world.model_dir, pre_read_hook="agent_hooks:block", store_dirs=[world.store])
    client = httpx.Client(base_url=proc.url, timeout=120.0)
    try:
        pull = Background(lambda: client.post("/pull_weights", json={"target_version": 1, "source_dir": str(world.store)}))
        wait_until(entered.exists, what="the pre-read hook to start")
        for _ in range(3):
            assert len(world.greedy(client)) == GREEDY["max_new_tokens"]
        assert client.get("/agent_info").json()["pulling"] == 1 and not pull.done()
        release.touch()
        result = pull.result()
        assert result.status_code == 200 and result.json()["version"] == 1, result.text
    finally:
        release.touch()
        client.close()
        proc.stop()


def test_an_unreachable_engine_is_a_502(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    proc = launch_agent(dead, tmp_path / "ckpt", log_path=tmp_path / "agent.log")
    try:
        with httpx.Client(base_url=proc.url, timeout=30.0) as client:
            response = client.post("/generate", json={"input_ids": PROMPT})
            assert response.status_code == 502
            assert response.json()["error"]["type"] == "EngineUnreachable" and dead in response.json()["message"]
            pulled = client.post("/pull_weights", json={"target_version": 1, "source_dir": str(tmp_path)})
            assert pulled.status_code == 502, pulled.text  # the base checkpoint is read from the engine
            assert client.get("/agent_info").json()["engine_url"] == dead
    finally:
        proc.stop()


@pytest.mark.parametrize("url", ["not-a-url", "ftp://127.0.0.1:30000", "http://127.0.0.1:30000/generate",
                                 "http://127.0.0.1"])
def test_the_cli_refuses_a_bad_engine_url(tmp_path, url):
    result = subprocess.run(
        [sys.executable, "-m", "miles_disagg.cli", "agent", "--engine-url", url,
         "--local-checkpoint-dir", str(tmp_path / "ckpt"), "--port", str(free_port())],
        capture_output=True, text=True, timeout=scaled(60))
    assert result.returncode == 2, result.stderr
    assert "--engine-url" in result.stderr and url in result.stderr and "Traceback" not in result.stderr


def test_a_pull_never_rewrites_a_slot_an_activation_still_reads(tiny_qwen3_dir, tmp_path):
    """In process: the slot of version N is the scratch of the pull of N+2; that pull must wait."""
    from miles_disagg.engines.agent.state import Agent, AgentConfig
    from miles_disagg.engines.builtin.control_bodies import PullWeights
    from miles_disagg.types import Retryable
    from miles_disagg.weights.publisher import DeltaPublisher

    publisher = DeltaPublisher(tmp_path / "store", base_dir=tiny_qwen3_dir)
    publisher.capture_baseline()
    tensors = _load(tiny_qwen3_dir)
    for step in range(3):
        publisher.publish([("lm_head.weight", tensors["lm_head.weight"] + step + 1.0)])
    publisher.close()
    agent = Agent(AgentConfig(engine_url="http://127.0.0.1:1", local_checkpoint_dir=tmp_path / "ckpt",
                              base_dir=tiny_qwen3_dir, reader_wait_s=0.2, store_dirs=(tmp_path / "store",)))

    def pull(version: int) -> dict:
        return agent.pull(PullWeights(target_version=version, source_dir=str(tmp_path / "store"),
                                      local_checkpoint_dir=str(tmp_path / "ckpt")))

    first_slot = Path(pull(1)["path"])
    reading, ref = agent.begin_activation("1")  # the engine is loading version 1 from its slot
    assert reading == first_slot and ref.version == 1
    assert Path(pull(2)["path"]) != first_slot  # writes the other slot: allowed
    with pytest.raises(Retryable, match=str(first_slot)):
        pull(3)  # would rebuild the slot still being read
    assert agent.held()[0].version == 2
    agent.end_activation(reading, ref, 200, None)  # the engine finished reading
    assert pull(3)["path"] == str(first_slot) and agent.held()[0].version == 3
