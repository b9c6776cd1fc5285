"""The native Qwen3 computes what transformers' Qwen3ForCausalLM computes: logits, gradients,
the KV cache, and the state-dict names; anything else goes to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_disagg.models.causal_lm import NATIVE, TRANSFORMERS, implementation, load_causal_lm
from miles_disagg.models.qwen3 import Qwen3ForCausalLM, native_blocker
from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes
from miles_disagg.types import LayoutMismatch

TOLERANCE = 1e-5


def _checkpoint(path: Path, *, tie: bool, dtype=torch.float32) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=tie, pad_token_id=0, eos_token_id=1, rope_theta=5000.0)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():  # non-trivial norms
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path_factory.mktemp("qwen3"), tie=request.param)
    native = load_causal_lm(path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert isinstance(native, Qwen3ForCausalLM) and implementation(path)[0] == NATIVE
    return native, reference


def _right_padded_batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [14, 15, 16, 17, 18, 0]])
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 5])[:, None]).long()
    return ids, mask


def test_the_state_dicts_have_the_same_names_and_shapes(pair):
    native, reference = pair
    assert {k: tuple(v.shape) for k, v in native.state_dict().items()} == \
        {k: tuple(v.shape) for k, v in reference.state_dict().items()}


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_the_tensor_list_is_the_files(tmp_path, tie):
    from safetensors.torch import load_file

    path = _checkpoint(tmp_path, tie=tie)
    on_disk = {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}
    listed = qwen3_tensor_shapes(json.loads((path / "config.json").read_text()))
    assert dict(listed) == on_disk and len(listed) == len(on_disk)
    assert listed[0][0] == "model.embed_tokens.weight" and ("lm_head.weight" in on_disk) == (not tie)


def test_logits_of_a_padded_batch_match(pair):
    native, reference = pair
    ids, mask = _right_padded_batch()
    with torch.no_grad():
        ours = native(input_ids=ids, attention_mask=mask).logits
        theirs = reference(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() < TOLERANCE


def test_gradients_match(pair):
    native, reference = pair
    ids, mask = _right_padded_batch()
    for model in (native, reference):
        model.zero_grad(set_to_none=True)
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1], dim=-1)
        picked = logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1)
        (picked * mask[:, 1:]).sum().backward()
    theirs = dict(reference.named_parameters())
    for name, param in native.named_parameters():
        assert (param.grad - theirs[name].grad).abs().max() < 1e-4, name
    if not native.config.tie_word_embeddings:  # (tied, the output projection trains that row)
        assert native.model.embed_tokens.weight.grad[0].abs().max() == 0  # the padding token's row is not trained


def test_a_left_padded_prefill_then_cached_decode_matches_one_full_pass(pair):
    native, reference = pair
    prompts = [[5, 6, 7, 8], [9, 10]]
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = native(ids, attention_mask=mask, position_ids=positions, logits_to_keep=1)
        cache, steps = out.cache, [out.logits[:, -1]]
        next_ids, pos = torch.tensor([[20], [21]]), torch.tensor([[4], [2]])
        for _ in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
            out = native(next_ids, attention_mask=mask, position_ids=pos, cache=cache)
            cache, pos = out.cache, pos + 1
            steps.append(out.logits[:, -1])
        for row, prompt in enumerate(prompts):
            full = reference(input_ids=torch.tensor([prompt + [20 + row] * 3])).logits[0]
            expected = full[len(prompt) - 1:]
            assert (torch.stack([s[row] for s in steps]) - expected).abs().max() < TOLERANCE


def test_a_bfloat16_checkpoint_loads_in_its_dtype(tmp_path):
    path = _checkpoint(tmp_path / "bf16", tie=False, dtype=torch.bfloat16)
    assert {p.dtype for p in load_causal_lm(path).parameters()} == {torch.bfloat16}
    assert {p.dtype for p in load_causal_lm(path, dtype=torch.float32).parameters()} == {torch.float32}


def test_a_checkpoint_missing_a_tensor_is_a_layout_mismatch(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _checkpoint(tmp_path / "m", tie=False)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LayoutMismatch, match="up_proj"):
        load_causal_lm(path)


@pytest.mark.parametrize("change, named", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "LlamaForCausalLM"),
])
def test_what_it_does_not_reproduce_goes_to_transformers(tmp_path, change, named):
    path = _checkpoint(tmp_path / "c", tie=False)
    config = {**json.loads((path / "config.json").read_text()), **change}
    (path / "config.json").write_text(json.dumps(config))
    assert named in native_blocker(config)
    assert implementation(path) == (TRANSFORMERS, native_blocker(config))


def test_a_cuda_device_gets_transformers(tmp_path):
    path = _checkpoint(tmp_path / "g", tie=False)
    assert implementation(path, "cuda")[0] == TRANSFORMERS
