"""The fsdp backend trains a PEFT LoRA adapter (miles' ``--lora-rank`` group) on the CPU.

The base stays frozen and the optimizer holds the adapter's state only; the published policy is the
base merged with the current adapter (``--lora-train-only``: the base); the adapter leaves in PEFT's
saved form, which PEFT's own ``PeftModel`` loads onto transformers' Qwen3 to the same logits; a save
holds the adapter and its moments (not the base) and resumes exactly; ``--lora-adapter-path`` warm
starts and refuses an adapter that does not match the flags."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoint_reading import read_state
from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.config.components import TrainConfig
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError

pytestmark = pytest.mark.timeout(300)

LORA = dict(lr=1e-2, global_batch_size=4, micro_batch_size=2, train_backend="fsdp", lora_rank=4, lora_alpha=8,
            target_modules="all-linear")


def four_samples() -> list[Sample]:
    return [Sample(prompt_ids=[5, 6, 7], response_ids=[8 + i % 2, 9, 10 + i % 2], response_logprobs=[-4.6] * 3,
                   advantage=float(i % 2) - 0.5) for i in range(4)]


@pytest.fixture
def process_group():
    import torch.distributed as dist

    from miles_disagg.engines.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def backend(model_dir, **overrides):
    from miles_disagg.trainer.fsdp import FSDPBackend

    return FSDPBackend(TrainConfig(**{**LORA, **overrides}), str(model_dir), rank=0, world_size=1)


def write_adapter(trainer, directory) -> None:
    from safetensors.torch import save_file

    from miles_disagg.trainer.lora import adapter_config

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config(trainer.lora)))
    save_file(trainer.adapter_tensors(), str(directory / "adapter_model.safetensors"))


def test_adapter_trains_on_a_frozen_base_and_peft_loads_it(tiny_qwen3_dir, tmp_path, process_group) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    trainer = backend(tiny_qwen3_dir)
    base = load_file(str(tiny_qwen3_dir / "model.safetensors"))
    trained = {n for n, p in trainer.module.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n for n in trained)
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(trained)
    before = trainer.adapter_tensors()
    assert all(torch.count_nonzero(t) == 0 for n, t in before.items() if "lora_B" in n)  # starts as the base
    trainer.train([four_samples()])
    after = trainer.adapter_tensors()
    assert any(not torch.equal(before[n], after[n]) for n in after)
    assert len(trainer.optimizer.state) == len(trained)
    policy = dict(trainer.named_tensors())
    assert set(policy) == set(base)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(policy[q], base[q])
    assert all(torch.equal(policy[n], base[n]) for n in base if "norm" in n or "embed" in n)

    write_adapter(trainer, tmp_path / "adapter")
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ours = trainer.module(ids).logits
        theirs = peft_model(input_ids=ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)

    base_only = backend(tiny_qwen3_dir, lora_train_only=True)
    base_only.train([four_samples()])
    assert all(torch.equal(t, base[n]) for n, t in base_only.named_tensors())  # rolls out on the base


def test_save_holds_the_adapter_and_resumes_exactly(tiny_qwen3_dir, tmp_path, process_group) -> None:
    trainer = backend(tiny_qwen3_dir)
    trainer.train([four_samples()])
    trainer.save_checkpoint(str(tmp_path / "save"))
    saved = read_state(tmp_path / "save")
    assert saved["model"] and all(".lora_" in name for name in saved["model"])  # no base weights
    assert all(".lora_" in key for key in saved["optimizer"] if key.startswith("state."))
    restored = backend(tiny_qwen3_dir)
    restored.load_checkpoint(str(tmp_path / "save"))
    adapter = trainer.adapter_tensors()
    assert all(torch.equal(t, adapter[n]) for n, t in restored.adapter_tensors().items())
    trainer.train([four_samples()])
    restored.train([four_samples()])
    again = trainer.adapter_tensors()
    assert all(torch.equal(t, again[n]) for n, t in restored.adapter_tensors().items())  # the moments came back


def test_warm_start_from_a_peft_adapter(tiny_qwen3_dir, tmp_path) -> None:
    trainer = backend(tiny_qwen3_dir)
    trainer.train([four_samples()])
    write_adapter(trainer, tmp_path / "adapter")
    warm = backend(tiny_qwen3_dir, lora_adapter_path=str(tmp_path / "adapter"))
    adapter = trainer.adapter_tensors()
    assert all(torch.equal(t, adapter[n]) for n, t in warm.adapter_tensors().items())
    with pytest.raises(ConfigError, match="--lora-adapter-path") as info:
        backend(tiny_qwen3_dir, lora_rank=8, lora_adapter_path=str(tmp_path / "adapter"))
    assert "'r': 4" in str(info.value)
    with pytest.raises(ConfigError, match="not a readable PEFT adapter"):
        backend(tiny_qwen3_dir, lora_adapter_path=str(tmp_path / "absent"))


def test_moe_experts_are_refused_attention_is_covered(tiny_qwen3_moe_dir) -> None:
    with pytest.raises(ConfigError, match="experts") as info:
        backend(tiny_qwen3_moe_dir)
    assert "--target-modules attn" in str(info.value)
    trainer = backend(tiny_qwen3_moe_dir, target_modules="attn")
    assert {n.split(".")[-3] for n in trainer.adapter_tensors()} == {"q_proj", "k_proj", "v_proj", "o_proj"}
