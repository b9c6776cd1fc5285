"""LoRA adapter versions through the version store: the trainer's adapter, in PEFT's form, published
step after step as deltas (the plain format, a full anchor every third version), materialized on
a host byte for byte, loaded by PEFT's own ``PeftModel``; corrupted versions are refused (exit 2
from ``miles-disagg weights``) with the host's held version unchanged."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_fixtures import lora_samples, lora_trainer

from miles_disagg.types import ChecksumMismatch, FormatError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def published(tiny_qwen3_dir, tmp_path_factory):
    """Four adapter versions of one trainer in a store; the trainer's adapter at each version."""
    from miles_disagg.trainer.lora import adapter_config
    from miles_disagg.weights.adapters import write_adapter_dir
    from miles_disagg.weights.publisher import DeltaPublisher

    tmp = tmp_path_factory.mktemp("adapters")
    trainer = lora_trainer(tiny_qwen3_dir, lr=1e-2)
    initial = write_adapter_dir(tmp / "adapter-v0", adapter_config(trainer.lora), trainer.adapter_tensors())
    publisher = DeltaPublisher(tmp / "store", base_dir=initial, run_id="lora-run", encoding="xor", filter="none",
                               full_anchor_interval=3, prune_on_anchor=False)
    publisher.capture_baseline()
    adapters, results = {}, {}
    for version in range(1, 5):
        trainer.train([lora_samples(version)])
        adapters[version] = trainer.adapter_tensors()
        results[version] = publisher.publish(adapters[version].items())
    publisher.close()
    return {"tmp": tmp, "initial": initial, "store": tmp / "store", "adapters": adapters, "results": results,
            "model": tiny_qwen3_dir, "trainer": trainer}


def test_versions_are_adapter_deltas_in_the_plain_format(published) -> None:
    from miles_disagg.weights.stores import open_store

    store = open_store(published["store"])
    assert store.latest().version == 4
    encodings = [store.read_index(v).delta_encoding for v in (1, 2, 3, 4)]
    assert encodings == ["xor", "xor", "full", "xor"]
    assert all(store.read_index(v).filter == "none" for v in (1, 2, 3, 4))
    names = set(published["adapters"][4])
    assert all(set(store.read_index(v).weight_map) <= names for v in (1, 2, 4))
    assert all(name.startswith("base_model.model.") and ".lora_" in name for name in names)


def test_a_host_materializes_the_trainers_adapter_byte_for_byte(published, tmp_path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from miles_disagg.weights.adapters import check_adapter_dir
    from miles_disagg.weights.materializer import Materializer

    host = Materializer(tmp_path / "local", base_dir=published["initial"])
    for version in (2, 4):  # from the initial adapter through deltas, then on from version 2
        prepared = host.prepare(published["store"], version)
        held = load_file(str(prepared.path / "adapter_model.safetensors"))
        expected = published["adapters"][version]
        assert set(held) == set(expected)
        assert all(held[n].numpy().tobytes() == expected[n].numpy().tobytes() for n in expected)
    info = check_adapter_dir(host.local_dir)
    assert (info.rank, info.alpha) == (4, 8.0) and len(info.modules) == 14
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(published["model"]),
                                           str(host.local_dir)).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=ids).logits, published["trainer"].module(ids).logits,
                                   rtol=1e-4, atol=1e-5)
    host.close()


def test_corrupted_adapter_versions_are_refused_and_nothing_changes(published, tmp_path) -> None:
    import shutil

    from miles_disagg.weights.materializer import Materializer
    from miles_disagg.weights.stores import open_store

    store_dir = tmp_path / "store"
    shutil.copytree(published["store"], store_dir)
    host = Materializer(tmp_path / "local", base_dir=published["initial"])
    host.prepare(store_dir, 1)
    store = open_store(store_dir)
    payload = next(store.version_files(2).glob("*.safetensors"))
    data = bytearray(payload.read_bytes())
    data[-5] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises((ChecksumMismatch, FormatError)):
        host.prepare(store_dir, 2)
    assert host.held().version == 1
    cli = subprocess.run([str(Path(sys.executable).parent / "miles-disagg"), "weights", "apply", "--store", str(store_dir),
                          "--base-dir", str(published["initial"]), "--local-dir", str(tmp_path / "local"),
                          "--to-version", "2"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "error: checksum mismatch" in cli.stderr.strip().splitlines()[-1], cli.stderr
    assert host.held().version == 1

    bad_base = tmp_path / "bad-v0"
    shutil.copytree(published["initial"], bad_base)
    config = json.loads((bad_base / "adapter_config.json").read_text())
    (bad_base / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))  # the tensors say 4
    other = Materializer(tmp_path / "other", base_dir=bad_base)
    with pytest.raises(FormatError, match="r = 8"):
        other.prepare(published["store"], 1)
    assert other.held() is None
    host.close()
    other.close()
