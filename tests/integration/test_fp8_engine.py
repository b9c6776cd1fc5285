"""The built-in engine serves a blockwise-FP8 checkpoint on CPU: weights stored as float8_e4m3fn with
their scales, logprobs equal to transformers' over the dequantized weights, FP8 reported by
``/model_info`` and ``/server_info``, and FP8 versions pulled and activated byte-identical to
``convert-fp8`` of the trainer's weights."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_fixtures import ENGINE_URL_ENV, start_engine, stop_engine
from miles_disagg.models.fp8 import BlockFp8, dequantize_state
from miles_disagg.weights.checksums import checksum
from miles_disagg.weights.fp8_convert import convert_checkpoint
from miles_disagg.weights.publisher import DeltaPublisher

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(os.environ.get(ENGINE_URL_ENV)), reason="needs the built-in engine"),
]
SCHEME = BlockFp8((16, 16))
PROMPT = [5, 6, 7, 8, 9]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def state_of(directory: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def dequantized_copy(fp8_dir: Path, out: Path) -> Path:
    """An unquantized float32 checkpoint of the FP8 one's dequantized weights."""
    shutil.copytree(fp8_dir, out)
    for path in out.glob("*.safetensors"):
        path.unlink()
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    save_file(dequantize_state(state_of(fp8_dir), SCHEME, torch.float32), out / "model.safetensors",
              metadata={"format": "pt"})
    return out


def reference_logprobs(model_dir: Path, prompt: list[int], output: list[int]) -> list[float]:
    """transformers' logprob of each output token given everything before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(output)]


def served_logprobs(engine) -> tuple[list[int], list[float]]:
    answer = engine.generate({"input_ids": PROMPT, "sampling_params": GREEDY, "return_logprob": True})
    triples = answer["meta_info"]["output_token_logprobs"]
    return [t[1] for t in triples], [t[0] for t in triples]


@pytest.fixture(scope="module")
def world(tiny_qwen3_dir: Path, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-engine")
    fp8 = root / "fp8"
    convert_checkpoint(tiny_qwen3_dir, fp8, SCHEME)
    store, local = root / "store", root / "local" / "ckpt"
    local.parent.mkdir(parents=True)
    engine = start_engine(fp8, root, "--weight-store-dir", str(store), "--local-checkpoint-dir", str(local))
    yield root, fp8, store, local, engine
    stop_engine(engine)


def test_the_engine_reports_fp8_and_serves_the_dequantized_model(world) -> None:
    root, fp8, _, _, engine = world
    info = engine.get("/model_info").json()
    assert info["quantization"] == "fp8"
    assert info["quantization_config"]["weight_block_size"] == [16, 16]
    assert engine.get("/server_info").json()["quantization"] == "fp8"
    output, logprobs = served_logprobs(engine)
    reference = reference_logprobs(dequantized_copy(fp8, root / "dequantized"), PROMPT, output)
    assert max(abs(a - b) for a, b in zip(logprobs, reference)) < 1e-5


def test_an_fp8_version_activates_byte_identical_to_convert_fp8(world, tiny_qwen3_dir: Path) -> None:
    root, fp8, store, local, engine = world
    publisher = DeltaPublisher(store, base_dir=fp8)
    publisher.capture_baseline()
    generator = torch.Generator().manual_seed(3)
    trained = {n: t + 1e-3 * torch.randn(t.shape, generator=generator) for n, t in state_of(tiny_qwen3_dir).items()}
    version = publisher.publish(trained.items()).ref.version
    publisher.close()
    pulled = engine.post("/pull_weights", {"target_version": version, "source_dir": str(store),
                                           "local_checkpoint_dir": str(local)})
    assert pulled.status_code == 200, pulled.text
    activated = engine.post("/update_weights_from_disk", {"model_path": str(local), "weight_version": str(version)})
    assert activated.status_code == 200 and activated.json()["success"], activated.text

    trained_dir = root / "trained"
    shutil.copytree(tiny_qwen3_dir, trained_dir)
    save_file(trained, trained_dir / "model.safetensors", metadata={"format": "pt"})
    expected_dir = root / "trained-fp8"
    convert_checkpoint(trained_dir, expected_dir, SCHEME)
    expected = {n: checksum("xxh3-128", t.contiguous().view(torch.uint8).numpy())
                for n, t in state_of(expected_dir).items()}
    served = engine.get("/weight_checksums", params={"algorithm": "xxh3-128"}).json()["checksums"]
    assert served == expected
    output, logprobs = served_logprobs(engine)
    reference = reference_logprobs(dequantized_copy(expected_dir, root / "trained-dequantized"), PROMPT, output)
    assert max(abs(a - b) for a, b in zip(logprobs, reference)) < 1e-5
