"""The built-in engine on a CUDA device: generation, logprobs and a staged update.

GPU-only: skipped with a reason where no CUDA device is present (CI and the 2-core
development machines). The same logic runs on CPU in the other engine tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_fixtures import start_engine, stop_engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> Path:
    """The engine's version store and local checkpoint live here (the only paths it may use)."""
    return tmp_path_factory.mktemp("gpu-roots")


@pytest.fixture(scope="module")
def cuda_engine(tiny_qwen3_dir, tmp_path_factory, roots):
    handle = start_engine(tiny_qwen3_dir, tmp_path_factory.mktemp("gpu"), "--device", "cuda", "--dtype", "float32",
                          "--weight-store-dir", str(roots / "store"), "--local-checkpoint-dir", str(roots / "local"))
    yield handle
    stop_engine(handle)


def test_cuda_generation_logprobs_match_a_forward_pass(cuda_engine, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    result = cuda_engine.generate({"input_ids": PROMPT, "return_logprob": True,
                                   "sampling_params": {"max_new_tokens": 16, "temperature": 0.8,
                                                       "ignore_eos": True, "sampling_seed": 3}})
    assert cuda_engine.get("/get_server_info").json()["device"] == "cuda"
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([PROMPT + result["output_ids"]])).logits[0]
    logprobs = torch.log_softmax(logits / 0.8, dim=-1)
    expected = [float(logprobs[len(PROMPT) - 1 + i, tok]) for i, tok in enumerate(result["output_ids"])]
    reported = [t[0] for t in result["meta_info"]["output_token_logprobs"]]
    assert max(abs(a - b) for a, b in zip(reported, expected)) < 1e-3  # TF32/cuBLAS vs CPU


def test_cuda_staged_update_activates_the_pulled_version(cuda_engine, tiny_qwen3_dir, roots):
    from safetensors.torch import load_file

    from miles_disagg.weights.publisher import DeltaPublisher

    store = roots / "store"
    publisher = DeltaPublisher(store, base_dir=tiny_qwen3_dir)
    publisher.capture_baseline()
    head = load_file(str(tiny_qwen3_dir / "model.safetensors"))["lm_head.weight"]
    version = publisher.publish([("lm_head.weight", head + 1.0)]).ref.version
    publisher.close()
    pulled = cuda_engine.post("/pull_weights", {"target_version": version, "source_dir": str(store),
                                                "local_checkpoint_dir": str(roots / "local")})
    assert pulled.status_code == 200, pulled.text
    activated = cuda_engine.post("/update_weights_from_disk", {"model_path": str(roots / "local"),
                                                               "weight_version": str(version)})
    assert activated.status_code == 200 and activated.json()["activation"] == "staged", activated.text
    assert cuda_engine.version() == str(version)
