"""The disk-delta updater against real built-in engines: success, and a failing engine.

A failure in the prepare phase (one engine's pull is refused) fails the update before any
pause: both engines keep serving their version and none is left paused. A failure in the
activation phase still continues every engine. With eight engines, one of whose loads breaks,
the one-call activation (``/activate_weights``, which the engines announce) and the per-step
sequence end the same way: the update fails naming that engine, every engine serves a
verified version (the new one, or the one it had) and none is left paused.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from engine_fixtures import greedy_reference, inprocess_engine
from miles_disagg.engines.activation import ActivationFailed
from miles_disagg.engines.async_client import AsyncEngineClient
from miles_disagg.engines.launch import launch_engine
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


# --------------------------------------------------------------------------- eight engines, one load breaks

NUM_ENGINES, FAULTY = 8, 5
PROMPT, NUM_TOKENS = [5, 6, 7, 8], 6


@pytest.fixture(scope="module")
def eight(tiny_qwen3_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """Seven engine processes and, at index FAULTY, one in this process (so a test can break its load);
    versions 1 and 2 published. Yields (root, urls, the in-process Engine, tensors by version)."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("eight")
    store = root / "store"
    roots = lambda i: ["--weight-store-dir", str(store), "--local-checkpoint-dir", str(root / f"local-{i}")]  # noqa: E731
    # one after the other from this thread: an engine dies with the thread that started it (PDEATHSIG)
    launched = [launch_engine(tiny_qwen3_dir, log_path=root / f"engine-{i}.log", extra_args=roots(i))
                for i in range(NUM_ENGINES) if i != FAULTY]
    publisher = DeltaPublisher(store, base_dir=tiny_qwen3_dir)
    publisher.capture_baseline()
    tensors = {0: load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))}
    generator = torch.Generator().manual_seed(8)
    for version in (1, 2):
        tensors[version] = {n: t + 0.3 * torch.randn(t.shape, generator=generator) for n, t in tensors[version - 1].items()}
        publisher.publish(tensors[version].items())
    publisher.close()
    try:
        with inprocess_engine(tiny_qwen3_dir, weight_store_dirs=[store],
                              local_checkpoint_dir=root / f"local-{FAULTY}") as (faulty, handle):
            urls = [e.url for e in launched]
            urls.insert(FAULTY, handle.url)
            yield root, urls, faulty, tensors
    finally:
        for engine in launched:
            engine.stop()


class PerStepUpdater(DiskDeltaUpdater):
    """The per-step sequence whatever the engines announce (as for a stock SGLang)."""

    async def prepare_one(self, index: int, engine, version: int) -> None:
        await super().prepare_one(index, engine, version)
        engine.one_call_activation = False


@pytest.mark.timeout(900)
@pytest.mark.parametrize("one_call, version", [(True, 1), (False, 2)])
def test_a_failing_load_on_one_of_eight_engines_fails_the_update_and_every_engine_serves_a_verified_version(
        eight, tiny_qwen3_dir: Path, monkeypatch, one_call: bool, version: int) -> None:
    root, urls, faulty, tensors = eight
    held_by_faulty = faulty.version

    def broken_swap(_tensors):
        raise RuntimeError("injected: this engine's load breaks")

    monkeypatch.setattr(faulty.runner, "swap_in", broken_swap)
    one_calls: list[str] = []
    real_one_call = AsyncEngineClient.activate_in_one_call

    async def recorded_one_call(self, *args):
        one_calls.append(self.url)
        return await real_one_call(self, *args)

    monkeypatch.setattr(AsyncEngineClient, "activate_in_one_call", recorded_one_call)
    events: list[tuple[str, str]] = []
    kind = DiskDeltaUpdater if one_call else PerStepUpdater
    updater = kind(urls, store_dir=str(root / "store"), local_dirs=[str(root / f"local-{i}") for i in range(len(urls))],
                   set_state=lambda url, state: events.append((url, state)))
    try:
        with pytest.raises(UpdateFailed) as failed:
            updater.update(version)
    finally:
        updater.close()

    message = str(failed.value)
    assert message.startswith(f"activate on {urls[FAULTY]}: activation of v{version} failed: ")
    assert "injected: this engine's load breaks" in message
    assert not any(url in message for i, url in enumerate(urls) if i != FAULTY)  # only the faulty engine failed
    assert sorted(one_calls) == (sorted(urls) if one_call else [])
    for url in urls:  # the router stopped routing to each engine, then routed to it again
        assert [state for u, state in events if u == url] == ["paused", "ready"]
    served = states_of(urls)
    assert served == [(held_by_faulty if i == FAULTY else str(version), None) for i in range(len(urls))]
    for url, (label, _) in zip(urls, served):  # each serves the weights its label names
        output = httpx.post(f"{url}/generate", json={"input_ids": PROMPT, "sampling_params": {
            "max_new_tokens": NUM_TOKENS, "temperature": 0.0, "ignore_eos": True}}, timeout=60).json()["output_ids"]
        assert output == greedy_reference(tiny_qwen3_dir, tensors[int(label)], PROMPT, NUM_TOKENS), url


def states_of(urls: list[str]) -> list[tuple[str, str | None]]:
    out = []
    for url in urls:
        info = httpx.get(f"{url}/get_server_info", timeout=30).json()
        out.append((info["weight_version"], info["internal_states"][0]["paused_mode"]))
    return out


