"""The disk-delta updater against two real built-in engines: success, and a failing engine.

A failure in the prepare phase (one engine's pull is refused) fails the update before any
pause: both engines keep serving their version and none is left paused. A failure in the
activation phase still continues every engine.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from miles_disagg.engines.launch import launch_engine
from miles_disagg.engines.activation import ActivationFailed
from miles_disagg.engines.updater import DiskDeltaUpdater, UpdateFailed
from miles_disagg.weights.publisher import DeltaPublisher

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("updater")
    engines = [launch_engine(tiny_qwen3_dir, log_path=root / f"engine-{i}.log",
                             extra_args=["--weight-store-dir", str(root / "store"),
                                         "--local-checkpoint-dir", str(root / f"local-{i}")]) for i in range(2)]
    publisher = DeltaPublisher(root / "store", base_dir=tiny_qwen3_dir)
    publisher.capture_baseline()
    from safetensors.torch import load_file

    tensors = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        tensors = {n: t + 0.01 * torch.randn(t.shape, generator=generator) for n, t in tensors.items()}
        publisher.publish(tensors.items())
    yield root, engines
    for engine in engines:
        engine.stop()


def states(engines) -> list[tuple[str, str | None]]:
    out = []
    for engine in engines:
        info = httpx.get(f"{engine.url}/get_server_info", timeout=30).json()
        out.append((info["weight_version"], info["internal_states"][0]["paused_mode"]))
    return out


def test_update_reaches_both_engines_in_order(world) -> None:
    root, engines = world
    events: list[tuple[str, str]] = []
    updater = DiskDeltaUpdater([e.url for e in engines], store_dir=str(root / "store"),
                               local_dirs=[str(root / f"local-{i}") for i in range(2)],
                               set_state=lambda url, state: events.append((url, state)))
    report = updater.update(1)
    assert states(engines) == [("1", None), ("1", None)]
    assert report.prepare_time_s > 0 and report.pause_time_s > 0 and len(report.per_engine_pause_s) == 2
    for engine in engines:
        assert [s for u, s in events if u == engine.url] == ["paused", "ready"]


def test_a_refused_pull_fails_before_any_pause(world) -> None:
    root, engines = world
    bad_local = root / "not-a-dir"
    bad_local.write_text("a file where the local checkpoint should be")
    events: list[tuple[str, str]] = []
    updater = DiskDeltaUpdater([e.url for e in engines], store_dir=str(root / "store"),
                               local_dirs=[str(root / "local-0"), str(bad_local)],
                               set_state=lambda url, state: events.append((url, state)))
    before = states(engines)
    with pytest.raises(UpdateFailed, match="prepare on " + engines[1].url):
        updater.update(2)
    assert events == []  # nobody was paused
    assert states(engines) == before


def test_a_refused_activation_still_continues_every_engine(world) -> None:
    root, engines = world
    updater = DiskDeltaUpdater([e.url for e in engines], store_dir=str(root / "store"),
                               local_dirs=[str(root / f"local-{i}") for i in range(2)])
    updater.prepare(0, 2)
    updater.prepare(1, 2)
    for index in range(2):
        with pytest.raises(ActivationFailed, match="not weight_version '3'"):
            updater.activate(index, 3)  # version 3 was never pulled: the engine refuses to load it
    assert [paused for _, paused in states(engines)] == [None, None]
