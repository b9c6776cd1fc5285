"""Broadcast rank layout: world = 1 + every engine's TP size, engines at cumulative offsets.

A fake TP-2 engine (two worker processes joining at ``rank_offset + tp_rank``, as SGLang's TP
workers do) and a built-in engine (one rank) join the trainer's group through the real
``BroadcastUpdater``; the test is the trainer's rank 0. With ``rank_offset = i + 1`` and
``world_size = engines + 1`` the fake engine's second rank would collide with the built-in one
and the rendezvous would never complete.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from engine_fixtures import Background, free_port, start_engine, stop_engine

from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.updater import BroadcastUpdater, engine_ranks
from miles_disagg.net.process import start_http_process

pytestmark = pytest.mark.timeout(240)
GROUP = "miles_disagg_weight_update"


@pytest.fixture
def tp2_engine(tmp_path):
    port = free_port()
    fake = start_http_process(
        [sys.executable, str(Path(__file__).with_name("fake_tp_engine.py")), "--port", str(port), "--tp-size", "2"],
        url=f"http://127.0.0.1:{port}", log_path=tmp_path / "fake-tp2.log", health_path="/health",
        what="fake TP-2 engine", error=RuntimeError, startup_timeout_s=120)
    yield fake.url
    fake.stop()


@pytest.fixture
def builtin_engine(tiny_qwen3_dir, tmp_path):
    handle = start_engine(tiny_qwen3_dir, tmp_path)
    yield handle
    stop_engine(handle)


def test_a_tp2_engine_joins_with_two_ranks_beside_a_one_rank_engine(tp2_engine, builtin_engine, tiny_qwen3_dir):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles_disagg.distributed import init_custom_process_group

    urls = [tp2_engine, builtin_engine.url]
    ranks = []
    for url in urls:
        with EngineClient(url) as client:
            ranks.append(engine_ranks(client.server_info()))
    assert ranks == [2, 1]
    updater = BroadcastUpdater(urls, pause_mode="retract", group_name=GROUP, ranks_per_engine=ranks)
    assert updater.world_size == 4 and updater.rank_offsets == [1, 3]

    port = free_port()
    joining = Background(lambda: updater.init_group("127.0.0.1", port))
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=4,
                                      rank=0, group_name=GROUP, timeout_s=90)
    try:
        joining.result()
        tensors = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
        names = sorted(tensors)
        new = {n: tensors[n] + 0.25 for n in names}
        meta = {"names": names, "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in names],
                "shapes": [list(new[n].shape) for n in names]}
        updating = Background(lambda: updater.update(3, meta))
        for name in names:
            dist.broadcast(new[name], src=0, group=group)
        report = updating.result()
    finally:
        dist.destroy_process_group(group)
        updater.close()

    assert report.version == 3
    workers = EngineClient(tp2_engine).get("/received")["workers"]
    assert sorted(w["rank"] for w in workers) == [1, 2]
    for worker in workers:
        for name in names:
            assert worker["tensors"][name]["shape"] == list(new[name].shape)
            assert worker["tensors"][name]["sum"] == pytest.approx(float(new[name].double().sum()), rel=1e-6)
    with EngineClient(builtin_engine.url) as client:
        assert client.version() == 3
    served = builtin_engine.generate({"input_ids": [9, 10, 11], "sampling_params": {"max_new_tokens": 1}})
    assert served["meta_info"]["weight_version"] == "3"
