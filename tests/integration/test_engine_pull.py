"""``/pull_weights`` + staged activation on the built-in engine, end to end over HTTP.

Versions are published with the weights package's ``DeltaPublisher`` onto a store; the
engine materializes them into a host-local checkpoint while serving, then
``/update_weights_from_disk`` naming the pulled version swaps the staged tensors in.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from deadlines import scaled
import torch

from engine_fixtures import ENGINE_URL_ENV, Background, start_engine, stop_engine, greedy_reference

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(bool(os.environ.get(ENGINE_URL_ENV)), reason="needs the built-in engine"),
]
GREEDY = {"max_new_tokens": 10, "temperature": 0.0, "ignore_eos": True}
PROMPT = [5, 6, 7, 8]


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def _greedy_reference(model_dir, tensors) -> list[int]:
    return greedy_reference(model_dir, tensors, PROMPT, GREEDY["max_new_tokens"])


class World:
    """A model dir, a store with published versions, a local checkpoint dir, an engine."""

    def __init__(self, root: Path, base: Path):
        from miles_disagg.weights.publisher import DeltaPublisher

        self.model_dir = root / "model"
        shutil.copytree(base, self.model_dir)
        self.store = root / "store"
        self.local = root / "local" / "ckpt"
        self.local.parent.mkdir(parents=True)
        self.publisher = DeltaPublisher(self.store, base_dir=self.model_dir)
        self.publisher.capture_baseline()
        self.tensors = _load(self.model_dir)
        self.engine = start_engine(self.model_dir, root, "--weight-store-dir", str(self.store),
                                   "--local-checkpoint-dir", str(self.local))

    def publish(self, names: list[str], seed: int) -> int:
        generator = torch.Generator().manual_seed(seed)
        for name in names:
            t = self.tensors[name]
            self.tensors[name] = t + 0.5 * torch.randn(t.shape, generator=generator, dtype=t.dtype)
        return self.publisher.publish((name, self.tensors[name]) for name in names).ref.version

    def pull(self, version: int):
        return self.engine.post("/pull_weights", {"target_version": version, "source_dir": str(self.store),
                                                  "local_checkpoint_dir": str(self.local)})

    def activate(self, version: int):
        return self.engine.post("/update_weights_from_disk",
                                {"model_path": str(self.local), "weight_version": str(version)})

    def greedy(self) -> list[int]:
        return self.engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir, tmp_path_factory):
    w = World(tmp_path_factory.mktemp("pull"), tiny_qwen3_dir)
    yield w
    stop_engine(w.engine)
    w.publisher.close()


def test_pull_then_staged_activation_serves_the_new_policy(world):
    before = world.greedy()
    version = world.publish(sorted(world.tensors), seed=1)  # every tensor changes
    pulled = world.pull(version)
    assert pulled.status_code == 200, pulled.text
    assert pulled.json()["success"] is True and pulled.json()["target_version"] == version
    assert world.engine.version() == "0" and world.greedy() == before  # staged, not live
    activated = world.activate(version)
    assert activated.status_code == 200, activated.text
    assert activated.json()["activation"] == "staged"
    assert world.engine.version() == str(version)
    assert world.greedy() == _greedy_reference(world.model_dir, world.tensors)


def test_second_pull_stages_only_changed_tensors(world):
    names = ["model.layers.0.mlp.down_proj.weight", "lm_head.weight"]
    version = world.publish(names, seed=2)
    pulled = world.pull(version)
    assert pulled.status_code == 200, pulled.text
    assert pulled.json()["num_tensors_staged"] == len(names) and pulled.json()["full"] is False
    activated = world.activate(version)
    assert activated.json()["activation"] == "staged", activated.text
    assert world.greedy() == _greedy_reference(world.model_dir, world.tensors)


def test_a_version_label_never_vouches_for_the_weights(world):
    """Base weights may not be loaded under the held version's label (403, nothing changed); loaded
    as what they are (version 0), they must not take a delta meant for the held version."""
    held = world.engine.version()
    output = world.greedy()
    relabelled = world.engine.post("/update_weights_from_disk", {"model_path": str(world.model_dir),
                                                                 "weight_version": held})
    assert relabelled.status_code == 403 and "holds verified version 0" in relabelled.text, relabelled.text
    assert world.engine.version() == held and world.greedy() == output
    reloaded = world.engine.post("/update_weights_from_disk", {"model_path": str(world.model_dir)})
    assert reloaded.status_code == 200 and reloaded.json()["activation"] == "disk", reloaded.text
    assert world.engine.version() == "0"  # no label given: the label is what the weights are
    version = world.publish(["model.layers.0.mlp.up_proj.weight"], seed=5)
    pulled = world.pull(version)
    assert pulled.status_code == 200 and pulled.json()["full"] is True, pulled.text
    assert world.activate(version).json()["activation"] == "staged"
    assert world.greedy() == _greedy_reference(world.model_dir, world.tensors)


def test_pull_announces_one_call_activation_and_it_activates_the_staged_version(world):
    info = world.engine.get("/get_server_info").json()
    assert info["miles_disagg"]["activate_weights"] is True
    version = world.publish(["model.layers.1.mlp.gate_proj.weight"], seed=7)
    pulled = world.pull(version)
    assert pulled.status_code == 200 and pulled.json()["miles_disagg"] == {"activate_weights": True}, pulled.text
    answer = world.engine.post("/activate_weights", {"weight_version": str(version)})  # model_path: its own
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["success"] is True and body["weight_version"] == str(version) and body["activation"] == "staged"
    assert body["pause_ms"] >= body["load"]["pause_ms"] >= 0
    assert world.engine.version() == str(version) and world.engine.internal_state()["paused_mode"] is None
    assert world.greedy() == _greedy_reference(world.model_dir, world.tensors)


def test_a_failing_one_call_activation_continues_the_engine_and_changes_nothing(world):
    held, output = world.engine.version(), world.greedy()
    answer = world.engine.post("/activate_weights", {"weight_version": "4242", "pause_mode": "retract"})
    assert answer.status_code == 503, answer.text  # the pause had begun: the engine's weights need checking
    body = answer.json()
    assert body["success"] is False and body["error"]["type"] == "ActivationFailed"
    assert body["message"].startswith("activation of v4242 failed: ") and "not weight_version '4242'" in body["message"]
    assert world.engine.internal_state()["paused_mode"] is None  # continued whatever happened
    assert world.engine.version() == held and world.greedy() == output
    refused = world.engine.post("/activate_weights", {"weight_version": "3", "model_path": str(world.model_dir) + "x"})
    assert refused.status_code == 403, refused.text  # outside the roots: refused before anything paused


def _corrupt_a_checksum(version_dir: Path) -> None:
    """Flip one hex digit of a published final-state checksum (header length unchanged)."""
    payload = sorted(version_dir.glob("*.safetensors"))[0]
    raw = bytearray(payload.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    name, checksum = next(iter(header["__metadata__"].items()))
    flipped = ("1" if checksum[-1] != "1" else "2")
    header["__metadata__"][name] = checksum[:-1] + flipped
    encoded = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(encoded) == length
    raw[8:8 + length] = encoded
    payload.write_bytes(bytes(raw))


def test_failed_checksum_is_4xx_and_changes_nothing(world):
    held = world.publish(["model.norm.weight"], seed=30)  # the host holds a verified version first
    assert world.pull(held).status_code == 200 and world.activate(held).status_code == 200
    version_before = world.engine.version()
    output_before = world.greedy()
    good = dict(world.tensors)
    version = world.publish(["model.layers.1.self_attn.q_proj.weight"], seed=3)
    from miles_disagg.types import version_dirname

    _corrupt_a_checksum(world.store / version_dirname(version))
    pulled = world.pull(version)
    assert 400 <= pulled.status_code < 500, pulled.text
    assert pulled.json()["success"] is False
    assert pulled.json()["error"]["type"] == "ChecksumMismatch", pulled.text
    assert world.engine.version() == version_before
    assert world.greedy() == output_before
    world.tensors = good
    # activating the version that failed to pull must not serve the held version under its label
    activated = world.activate(version)
    assert 400 <= activated.status_code < 500, activated.text
    assert activated.json()["success"] is False and "holds verified version" in activated.json()["message"]
    assert world.engine.version() == version_before
    assert world.greedy() == output_before


@pytest.mark.parametrize("body", [
    {}, {"target_version": -1, "source_dir": "s", "local_checkpoint_dir": "l"},
    {"target_version": "x", "source_dir": "s", "local_checkpoint_dir": "l"}, {"target_version": 1},
])
def test_pull_with_bad_fields_is_4xx(world, body):
    response = world.engine.post("/pull_weights", body)
    assert 400 <= response.status_code < 500, response.text


def test_pull_of_unpublished_version_is_4xx(world):
    response = world.pull(999)
    assert 400 <= response.status_code < 500, response.text


# --------------------------------------------------------------------------- pull never blocks generation


def test_requests_keep_completing_during_a_pull(tiny_qwen3_dir, monkeypatch):
    """In process: a materializer that blocks until released; generation must not wait for it."""
    from engine_fixtures import inprocess_engine
    from miles_disagg.types import VersionRef
    from miles_disagg.weights import materializer as materializer_module

    release, entered = threading.Event(), threading.Event()

    class BlockingMaterializer:
        def __init__(self, local_dir, *, base_dir, pre_read_hook=None, num_workers=2):
            self.base_dir = Path(base_dir)

        def prepare(self, store_dir, target_version=None):
            entered.set()
            assert release.wait(60)
            return materializer_module.PreparedVersion(VersionRef("run", 1), None, self.base_dir, ())

    monkeypatch.setattr(materializer_module, "Materializer", BlockingMaterializer)
    with inprocess_engine(tiny_qwen3_dir, weight_store_dirs=[Path("s")], local_checkpoint_dir=Path("l")) as (_engine, handle):
        try:
            pull = Background(lambda: handle.post("/pull_weights", {"target_version": 1, "source_dir": "s",
                                                                    "local_checkpoint_dir": "l"}))
            assert entered.wait(30)
            for _ in range(3):  # the pull is still blocked while these complete
                result = handle.generate({"input_ids": PROMPT, "sampling_params": GREEDY})
                assert result["meta_info"]["completion_tokens"] == GREEDY["max_new_tokens"]
            assert not pull.done()
            release.set()
            assert pull.result().status_code == 200
            activated = handle.post("/update_weights_from_disk", {"model_path": str(tiny_qwen3_dir),
                                                                  "weight_version": "1"})
            assert activated.json()["activation"] == "staged"
        finally:
            release.set()


HOOK_MODULE = """
import json, os

def record(source_dir, target_version):
    with open(os.environ["PRE_READ_HOOK_LOG"], "a") as f:
        f.write(json.dumps([source_dir, target_version]) + "\\n")
"""


def test_pre_read_hook_runs_before_a_pull_reads(tiny_qwen3_dir, tmp_path, monkeypatch):
    """``--custom-pull-weights-pre-read-hook`` gets SGLang's (source_dir, target_version)."""
    from miles_disagg.weights.publisher import DeltaPublisher

    (tmp_path / "my_hooks.py").write_text(HOOK_MODULE)
    log = tmp_path / "hook.log"
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PRE_READ_HOOK_LOG", str(log))
    store = tmp_path / "store"
    publisher = DeltaPublisher(store, base_dir=tiny_qwen3_dir)
    publisher.capture_baseline()
    tensors = _load(tiny_qwen3_dir)
    version = publisher.publish([("lm_head.weight", tensors["lm_head.weight"] + 1.0)]).ref.version
    engine = start_engine(tiny_qwen3_dir, tmp_path, "--custom-pull-weights-pre-read-hook", "my_hooks:record",
                          "--weight-store-dir", str(store), "--local-checkpoint-dir", str(tmp_path / "local"))
    try:
        pulled = engine.post("/pull_weights", {"target_version": version, "source_dir": str(store),
                                               "local_checkpoint_dir": str(tmp_path / "local")})
        assert pulled.status_code == 200, pulled.text
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        assert [str(store), version] in calls
    finally:
        stop_engine(engine)
        publisher.close()


def test_engine_refuses_a_bad_pre_read_hook_at_start(tiny_qwen3_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "miles_disagg.engines.builtin", "--model-path", str(tiny_qwen3_dir), "--port", "1",
         "--custom-pull-weights-pre-read-hook", "no_such_module_xyz:hook"],
        capture_output=True, text=True, timeout=scaled(120))
    assert result.returncode == 2
    assert "no_such_module_xyz" in result.stderr and "Traceback" not in result.stderr
