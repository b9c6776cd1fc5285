"""The built-in engine's colocation endpoints, with SGLang's request shapes:
``/release_memory_occupation``, ``/resume_memory_occupation`` (``tags``) and
``/update_weights_from_tensor`` (``serialized_named_tensors``, handles to shared memory)."""

from __future__ import annotations

import base64
import os
import pickle

import pytest
import torch

from engine_fixtures import ENGINE_URL_ENV, greedy_reference, start_engine, stop_engine

from miles_disagg.engines.client import EngineClient
from miles_disagg.engines.tensor_transfer import serialize_named_tensors

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(bool(os.environ.get(ENGINE_URL_ENV)), reason="drives the built-in engine")]
PROMPT = [9, 10, 11]
GREEDY = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def engine(tiny_qwen3_dir, tmp_path):
    """A fresh engine, for a test that changes its memory or weights."""
    handle = start_engine(tiny_qwen3_dir, tmp_path)
    yield handle
    stop_engine(handle)


@pytest.fixture(scope="module")
def untouched_engine(tiny_qwen3_dir, tmp_path_factory):
    """One engine for the refused requests: each case checks that it left the engine as it was."""
    handle = start_engine(tiny_qwen3_dir, tmp_path_factory.mktemp("engine"))
    yield handle
    stop_engine(handle)


def _new_weights(model_dir, shift: float) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = load_file(str(next(model_dir.glob("*.safetensors"))))
    generator = torch.Generator().manual_seed(3)
    return {n: t + shift * torch.randn(t.shape, generator=generator) for n, t in tensors.items()}


def test_release_resume_and_load_by_reference(engine, tiny_qwen3_dir):
    client = EngineClient(engine.url)
    client.release_memory(None)  # every tag
    assert client.server_info()["internal_states"][0]["memory_released"] == ["cuda_graph", "kv_cache", "weights"]
    refused = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert refused.status_code == 409 and "resume_memory_occupation" in refused.text

    new = _new_weights(tiny_qwen3_dir, 0.5)
    payload = serialize_named_tensors(sorted(new.items()))
    early = engine.post("/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert early.status_code == 409 and early.json()["success"] is False  # the weights are not resident

    client.resume_memory(["weights"])
    not_loaded = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert not_loaded.status_code == 409  # kv_cache still released (and the weights hold no values yet)
    client.begin_weight_update()
    client.update_weights_from_tensor([payload], weight_version=5, flush_cache=True)
    client.end_weight_update()
    client.resume_memory(["kv_cache", "cuda_graph"])

    assert client.version() == 5
    output = engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]
    assert output == greedy_reference(tiny_qwen3_dir, new, PROMPT, GREEDY["max_new_tokens"])


def test_weights_loaded_in_parts_serve_only_once_all_are_back(engine, tiny_qwen3_dir):
    client = EngineClient(engine.url)
    client.release_memory(["weights"])
    client.resume_memory(["weights"])
    new = sorted(_new_weights(tiny_qwen3_dir, 0.1).items())
    client.update_weights_from_tensor([serialize_named_tensors(new[:3])])
    partial = engine.post("/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert partial.status_code == 409 and "not loaded yet" in partial.text
    client.update_weights_from_tensor([serialize_named_tensors(new[3:])], weight_version=1)
    assert engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["meta_info"]["weight_version"] == "1"


@pytest.mark.parametrize("path, body, status", [
    ("/release_memory_occupation", {"tags": ["gpu_everything"]}, 400),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [base64.b64encode(
        pickle.dumps([("lm_head.weight", os.getpid)])).decode()]}, 400),
    ("/update_weights_from_tensor", {"serialized_named_tensors": [
        serialize_named_tensors([("lm_head.weight", torch.zeros(2, 2))])]}, 400),
    ("/update_weights_from_tensor", {"serialized_named_tensors": []}, 400),
    ("/update_weights_from_tensor", {"serialized_named_tensors": ["x"], "load_format": "flattened_bucket"}, 400),
])
def test_bad_requests_are_refused_and_change_nothing(untouched_engine, path, body, status):
    engine = untouched_engine
    before = engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"]
    response = engine.post(path, body)
    assert response.status_code == status, response.text
    assert response.json()["success"] is False
    assert engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY})["output_ids"] == before
