"""The native Qwen3-MoE computes what transformers' Qwen3MoeForCausalLM computes (logits, gradients,
KV cache), keeps the on-disk tensor names, replays a given routing, and reports the routing it used;
transformers' fused in-memory expert tensors convert to exactly what save_pretrained writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from miles_disagg.models.causal_lm import NATIVE, implementation, load_causal_lm
from miles_disagg.models.moe_names import has_fused_experts, on_disk_tensors
from miles_disagg.models.qwen3_moe import Qwen3MoeForCausalLM
from miles_disagg.models.qwen3_tensors import qwen3_tensor_shapes

TOLERANCE = 1e-5


def _checkpoint(path: Path, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    shape = dict(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    config = Qwen3MoeConfig(**{**shape, **overrides})
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.5)  # decisive routing: no near-ties between experts
    model.save_pretrained(path)
    return path


VARIANTS = {
    "all-sparse": {},
    "mlp-only-layer-1": {"mlp_only_layers": [1]},
    "sparse-step-2-unnormalised": {"decoder_sparse_step": 2, "norm_topk_prob": False},
}


@pytest.fixture(scope="module", params=list(VARIANTS), ids=list(VARIANTS))
def pair(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path_factory.mktemp("qwen3moe"), **VARIANTS[request.param])
    native = load_causal_lm(path, dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert isinstance(native, Qwen3MoeForCausalLM) and implementation(path)[0] == NATIVE
    return native, reference, path


def _padded_batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [14, 15, 16, 17, 18, 0]])
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 5])[:, None]).long()
    return ids, mask


def test_state_dict_names_are_the_files_names(pair):
    from safetensors.torch import load_file

    native, _, path = pair
    on_disk = load_file(path / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in native.state_dict().items()} == {k: tuple(v.shape) for k, v in on_disk.items()}
    assert any(".mlp.experts.3.down_proj.weight" in k for k in on_disk)


def test_the_tensor_list_is_the_files(pair):
    from safetensors.torch import load_file

    _, _, path = pair
    on_disk = {k: tuple(v.shape) for k, v in load_file(path / "model.safetensors").items()}
    listed = qwen3_tensor_shapes(json.loads((path / "config.json").read_text()))
    assert dict(listed) == on_disk and len(listed) == len(on_disk)


def test_fused_transformers_tensors_convert_to_the_saved_ones_exactly(pair):
    from safetensors.torch import load_file

    _, reference, path = pair
    live = reference.state_dict()
    assert has_fused_experts(live)
    converted = dict(on_disk_tensors(live.items()))
    on_disk = load_file(path / "model.safetensors")
    assert set(converted) == set(on_disk)
    for name, tensor in on_disk.items():
        assert torch.equal(converted[name], tensor), name


def test_logits_of_a_padded_batch_match(pair):
    native, reference, _ = pair
    ids, mask = _padded_batch()
    with torch.no_grad():
        ours = native(input_ids=ids, attention_mask=mask)
        theirs = reference(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours.logits[real] - theirs[real]).abs().max() < TOLERANCE
    sparse = native.config.sparse_layers
    dense = [i for i in range(native.config.num_hidden_layers) if i not in sparse]
    assert (ours.routed_experts[:, :, dense] == -1).all()
    assert (ours.routed_experts[:, :, sparse] >= 0).all()


def test_gradients_match_under_the_on_disk_names(pair):
    native, reference, _ = pair
    ids, mask = _padded_batch()
    for model in (native, reference):
        model.zero_grad(set_to_none=True)
        logprobs = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1], dim=-1)
        (logprobs.gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]).sum().backward()
    theirs = dict(on_disk_tensors((n, p.grad if p.grad is not None else torch.zeros_like(p))
                                  for n, p in reference.named_parameters()))
    for name, param in native.named_parameters():
        ours = param.grad if param.grad is not None else torch.zeros_like(param)  # an expert no token chose
        assert (ours - theirs[name]).abs().max() < 1e-4, name


def test_kv_cached_decode_matches_a_full_forward(pair):
    native, _, _ = pair
    tokens = torch.tensor([[3, 9, 4, 22, 7, 11, 30, 2]])
    with torch.no_grad():
        full = native(tokens)
        out = native(tokens[:, :5])
        logits, routed = [out.logits[:, -1]], [out.routed_experts]
        cache = out.cache
        for step in range(5, 8):
            out = native(tokens[:, step:step + 1], cache=cache)
            cache = out.cache
            logits.append(out.logits[:, -1])
            routed.append(out.routed_experts)
    assert (torch.stack(logits[1:], 1) - full.logits[:, 5:8]).abs().max() < TOLERANCE
    assert torch.equal(torch.cat(routed, 1), full.routed_experts)


def test_a_replayed_routing_is_used_and_minus_one_routes_freely(pair):
    native, _, _ = pair
    config = native.config
    ids, mask = _padded_batch()
    with torch.no_grad():
        free = native(ids, attention_mask=mask).routed_experts
    forced = (free.long() + 1) % config.num_experts  # a different routing wherever a layer is sparse
    forced[:, :, [i for i in range(config.num_hidden_layers) if i not in config.sparse_layers]] = -1
    forced[:, 0] = -1  # position 0 routes freely
    with torch.no_grad():
        replayed = native(ids, attention_mask=mask, routing=forced)
    assert torch.equal(replayed.routed_experts[:, 1:], forced[:, 1:].to(torch.int32))
    assert torch.equal(replayed.routed_experts[:, 0], free[:, 0])
    with torch.no_grad():  # replaying the free routing reproduces the free forward exactly
        again = native(ids, attention_mask=mask, routing=free.long())
        plain = native(ids, attention_mask=mask)
    assert torch.equal(again.logits, plain.logits)


def test_replay_keeps_the_router_trainable(pair):
    native, _, _ = pair
    ids, mask = _padded_batch()
    with torch.no_grad():
        routing = native(ids, attention_mask=mask).routed_experts.long()
    native.zero_grad(set_to_none=True)
    native(ids, attention_mask=mask, routing=routing).logits.sum().backward()
    for layer in native.config.sparse_layers:
        assert native.model.layers[layer].mlp.gate.weight.grad.abs().sum() > 0


def test_a_routing_of_the_wrong_shape_is_refused(pair):
    native, _, _ = pair
    with pytest.raises(ValueError, match="routing has shape"):
        native(torch.tensor([[1, 2, 3]]), routing=torch.zeros((1, 2, 3, 2), dtype=torch.long))
