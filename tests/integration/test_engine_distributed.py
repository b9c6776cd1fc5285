"""``/init_weights_update_group`` + ``/update_weights_from_distributed`` with the test as trainer rank 0.

Works against any SGLang-compatible server reachable with gloo; against the built-in
engine the test also checks that the broadcast weights are the ones that serve.
"""

from __future__ import annotations

import os

import pytest
import torch

from engine_fixtures import ENGINE_URL_ENV, Background, free_port, start_engine, stop_engine, greedy_reference

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(bool(os.environ.get(ENGINE_URL_ENV)), reason="needs the built-in engine (gloo on CPU)"),
]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}
PROMPT = [9, 10, 11]


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir, tmp_path_factory):
    handle = start_engine(tiny_qwen3_dir, tmp_path_factory.mktemp("dist-logs"))
    yield handle
    stop_engine(handle)


def _greedy_reference(model_dir, tensors) -> list[int]:
    return greedy_reference(model_dir, tensors, PROMPT, GREEDY["max_new_tokens"])


def test_broadcast_update_serves_new_weights(engine, tiny_qwen3_dir):
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles_disagg.distributed import init_custom_process_group

    port = free_port()
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "weight_update_group", "backend": "gloo"}
    joined = Background(lambda: engine.post("/init_weights_update_group", body))
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                      rank=0, group_name="weight_update_group", timeout_s=60)
    try:
        response = joined.result()
        assert response.status_code == 200 and response.json()["success"] is True, response.text

        tensors = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
        generator = torch.Generator().manual_seed(0)
        names = sorted(tensors)
        new = {n: tensors[n] + 0.5 * torch.randn(tensors[n].shape, generator=generator) for n in names}
        update = {"names": names, "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in names],
                  "shapes": [list(new[n].shape) for n in names], "group_name": "weight_update_group",
                  "weight_version": "7"}
        updated = Background(lambda: engine.post("/update_weights_from_distributed", update))
        for name in names:
            dist.broadcast(new[name], src=0, group=group)
        response = updated.result()
        assert response.status_code == 200 and response.json()["success"] is True, response.text
    finally:
        dist.destroy_process_group(group)

    assert engine.version() == "7"
    output = engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]
    assert output == _greedy_reference(tiny_qwen3_dir, new)
    destroyed = engine.post("/destroy_weights_update_group", {"group_name": "weight_update_group"})
    assert destroyed.status_code == 200 and destroyed.json()["success"] is True, destroyed.text
    again = engine.post("/destroy_weights_update_group", {"group_name": "weight_update_group"})
    assert 400 <= again.status_code < 500  # miles tolerates this on a fresh engine


def test_distributed_update_without_group_is_4xx(engine):
    response = engine.post("/update_weights_from_distributed", {
        "names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[1, 1]], "group_name": "missing"})
    assert 400 <= response.status_code < 500 and response.json()["success"] is False


@pytest.mark.parametrize("body", [{}, {"master_address": "127.0.0.1", "master_port": "x", "rank_offset": 1,
                                       "world_size": 2}])
def test_init_group_with_bad_fields_is_4xx(engine, body):
    assert 400 <= engine.post("/init_weights_update_group", body).status_code < 500


def test_bucketed_broadcast_update_lands_whole_and_the_checksums_say_so(engine, tiny_qwen3_dir):
    """``--update-weight-buffer-size`` small enough for several buckets: the updater sends one
    ``/update_weights_from_distributed`` per bucket inside one pause, only the last sets the
    version; afterwards the engine's ``/weight_checksums`` are those of the broadcast tensors."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from miles_disagg.engines.builtin.dist_update import init_custom_process_group
    from miles_disagg.engines.updater import BroadcastUpdater, plan_buckets
    from miles_disagg.weights.checksums import checksum
    from miles_disagg.weights.torch_bytes import tensor_bytes

    tensors = load_file(str(next(tiny_qwen3_dir.glob("*.safetensors"))))
    names = sorted(tensors)
    generator = torch.Generator().manual_seed(1)
    new = {n: tensors[n] + 0.25 * torch.randn(tensors[n].shape, generator=generator) for n in names}
    meta = {"names": names, "dtypes": [str(new[n].dtype).removeprefix("torch.") for n in names],
            "shapes": [list(new[n].shape) for n in names]}
    bucket_bytes = 16 * 1024
    assert len(plan_buckets(meta, bucket_bytes)) > 3

    updater = BroadcastUpdater([engine.url], pause_mode="retract", group_name="bucketed", bucket_bytes=bucket_bytes)
    port = free_port()
    joined = Background(lambda: updater.init_group("127.0.0.1", port))
    group = init_custom_process_group(backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                      rank=0, group_name="bucketed", timeout_s=60)
    try:
        joined.result()
        updated = Background(lambda: updater.update(11, meta))
        for name in names:
            dist.broadcast(new[name], src=0, group=group)
        report = updated.result()
        assert report.version == 11
    finally:
        dist.destroy_process_group(group)
        updater.close()
        engine.post("/destroy_weights_update_group", {"group_name": "bucketed"})

    assert engine.version() == "11"
    output = engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]
    assert output == _greedy_reference(tiny_qwen3_dir, new)
    served = engine.get("/weight_checksums?algorithm=blake3").json()
    assert served["weight_version"] == "11" and served["source"] == "live"
    assert {n: served["checksums"][n] for n in names} == {n: checksum("blake3", tensor_bytes(new[n])) for n in names}
    assert engine.get("/weight_checksums?algorithm=md5").status_code == 400
