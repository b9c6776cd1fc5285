"""The fsdp backend trains the tiny Qwen3-MoE (native model, CPU) and replays routing.

Samples come from the built-in engine over real HTTP (``return_routed_experts``, ``return_logprob``),
as a rollout with ``--use-rollout-routing-replay`` makes them. With replay, every trained position
routes to the engine's experts (``train/routing_replay_match`` 1.0, checked independently through
the model's own report of the experts it used), the step-0 train-vs-rollout logprob difference is
below 1e-3, and a forged routing is replayed too (so the metric would fail if replay did not
happen). ``--use-routing-replay``: the training passes replay the routing of the first forward.
Every test runs on the native model and on transformers' (the CUDA path: replay through hooks on
its routers), forced onto the CPU.
"""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import inprocess_engine
from moe_fixtures import tiny_qwen3_moe_dir  # noqa: F401  (fixture)

from miles_disagg.config.components import TrainConfig
from miles_disagg.models.routed_experts_wire import decode_routed_experts
from miles_disagg.samples import Sample
from miles_disagg.types import ConfigError, InvalidInput

pytestmark = pytest.mark.timeout(300)
LAYERS, TOP_K, EXPERTS = 2, 2, 4


@pytest.fixture(params=["native", "transformers"], autouse=True)
def implementation(request, monkeypatch):
    """The trainer's model: the native Qwen3-MoE, or transformers' as on a CUDA device."""
    from miles_disagg.models import causal_lm

    if request.param == "transformers":
        monkeypatch.setattr(causal_lm, "implementation", lambda *_a, **_k: (causal_lm.TRANSFORMERS, "test"))
    return request.param


@pytest.fixture(scope="module")
def rollout(tiny_qwen3_moe_dir) -> list[Sample]:
    prompts = [[3 + i % 7, 4 + i % 5, 5, 6 + i % 3] for i in range(8)]
    with inprocess_engine(tiny_qwen3_moe_dir, enable_return_routed_experts=True) as (_engine, handle):
        results = handle.generate({"input_ids": prompts, "return_logprob": True, "return_routed_experts": True,
                                   "sampling_params": {"max_new_tokens": 5, "ignore_eos": True, "sampling_seed": 2}})
    samples = []
    for i, (prompt, result) in enumerate(zip(prompts, results)):
        meta = result["meta_info"]
        samples.append(Sample(
            prompt_ids=prompt, response_ids=result["output_ids"],
            response_logprobs=[t[0] for t in meta["output_token_logprobs"]], advantage=float(i % 2) - 0.5,
            rollout_routed_experts=decode_routed_experts(meta["routed_experts"], LAYERS, TOP_K).copy()))
    return samples


def _backend(model_dir, **flags):
    from miles_disagg.trainer.fsdp import FSDPBackend

    config = TrainConfig(**{"lr": 1e-2, "global_batch_size": 8, "micro_batch_size": 4, **flags})
    return FSDPBackend(config, str(model_dir), rank=0, world_size=1)


def _routing_of_training_forwards(backend) -> list[torch.Tensor | None]:
    """The routing given to every forward pass that builds a graph (the training passes)."""
    seen, forward = [], backend._forward

    def spy(model, batch, routing):
        if torch.is_grad_enabled():
            seen.append(routing)
        return forward(model, batch, routing)
    backend._forward = spy
    return seen


def test_rollout_routing_replay_uses_the_engines_experts(tiny_qwen3_moe_dir, rollout, implementation):
    from miles_disagg.models.qwen3_moe import Qwen3MoeForCausalLM

    backend = _backend(tiny_qwen3_moe_dir, use_rollout_routing_replay=True)
    assert isinstance(backend.module, Qwen3MoeForCausalLM) == (implementation == "native")
    from miles_disagg.trainer.batches import pack
    from miles_disagg.trainer.fsdp_routing import RoutingShape, pack_engine_routing

    batch = pack(rollout[:4])
    engine = pack_engine_routing(rollout[:4], batch.input_ids.shape[1], RoutingShape.of(backend.module))
    with torch.no_grad():
        used = backend._token_logprobs(backend.model, batch, False, engine)[2].routed_experts
    for i, sample in enumerate(rollout[:4]):
        positions = len(sample.prompt_ids) + len(sample.response_ids) - 1
        assert (used[i, :positions].numpy() == sample.rollout_routed_experts).all()

    seen = _routing_of_training_forwards(backend)
    result = backend.train([rollout])
    assert result.rollout["train/train_rollout_logprob_abs_diff"] < 1e-3
    step = result.steps[0]
    assert step["train/routing_replay_match"] == 1.0
    assert 0.0 <= step["train/routing_agreement"] <= 1.0
    assert len(seen) == 2 and all(r is not None for r in seen)  # both micro-batches replayed


def test_a_forged_routing_is_replayed_and_disagrees_with_the_router(tiny_qwen3_moe_dir, rollout):
    forged = [Sample(**{**s.__dict__, "rollout_routed_experts": (s.rollout_routed_experts + 1) % EXPERTS})
              for s in rollout]
    result = _backend(tiny_qwen3_moe_dir, use_rollout_routing_replay=True).train([forged])
    assert result.steps[0]["train/routing_replay_match"] == 1.0
    assert result.steps[0]["train/routing_agreement"] == 0.0  # (e+1) % 4 never equals the router's own set
    assert result.rollout["train/train_rollout_logprob_abs_diff"] > 1e-3  # other experts: other logprobs


def test_without_replay_the_agreement_is_logged(tiny_qwen3_moe_dir, rollout):
    step = _backend(tiny_qwen3_moe_dir).train([rollout]).steps[0]
    assert step["train/routing_agreement"] > 0.9  # the same weights route (almost) every token alike
    assert "train/routing_replay_match" not in step


def test_routing_replay_replays_the_first_forward_in_every_training_pass(tiny_qwen3_moe_dir, rollout):
    backend = _backend(tiny_qwen3_moe_dir, use_routing_replay=True)
    from miles_disagg.trainer.batches import pack

    with torch.no_grad():  # the routing before any step: what the first forward pass records
        before = [backend._forward(backend.model, pack(mb), None).routed_experts.long() for mb in (rollout[:4],
                                                                                                   rollout[4:])]
    seen = _routing_of_training_forwards(backend)
    config = backend.config
    backend.config = TrainConfig(**{**config.__dict__, "global_batch_size": 4})  # two optimizer steps
    backend.train([rollout[:4], rollout[4:]])
    assert len(seen) == 2
    for replayed, recorded in zip(seen, before):
        assert torch.equal(replayed, recorded)


def test_replay_on_samples_without_routing_is_refused(tiny_qwen3_moe_dir, rollout):
    bare = [Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, response_logprobs=s.response_logprobs)
            for s in rollout]
    with pytest.raises(InvalidInput, match="carry no rollout_routed_experts"):
        _backend(tiny_qwen3_moe_dir, use_rollout_routing_replay=True).train([bare])


def test_replay_flags_on_a_dense_model_are_refused(tiny_qwen3_dir):
    for flag in ("use_rollout_routing_replay", "use_routing_replay"):
        with pytest.raises(ConfigError, match="needs a mixture-of-experts model"):
            _backend(tiny_qwen3_dir, **{flag: True})


def test_an_expert_no_token_chose_keeps_its_weights_bit_identical(tiny_qwen3_moe_dir, rollout):
    """Every token forced onto experts 0 and 1: experts 2 and 3 get no gradient (native) or a zero one
    (transformers' fused experts, first step: zero Adam moments) and stay as they were."""
    forced = [Sample(**{**s.__dict__, "rollout_routed_experts": _only_experts_0_and_1(s.rollout_routed_experts)})
              for s in rollout]
    backend = _backend(tiny_qwen3_moe_dir, use_rollout_routing_replay=True)
    before = {n: t.clone() for n, t in backend.named_tensors()}
    backend.train([forced])
    after = dict(backend.named_tensors())
    for layer in range(LAYERS):
        for expert, changed in ((0, True), (2, False), (3, False)):
            name = f"model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"
            assert torch.equal(before[name], after[name]) != changed, name


def _only_experts_0_and_1(routed):
    out = routed.copy()
    out[...] = [0, 1]
    return out


def test_the_reference_replays_the_engines_routing_too(tiny_qwen3_moe_dir, rollout):
    """With --use-kl-loss the reference (the same base weights) replays the engine's routing as the
    policy does: at the first optimizer step both are the same model on the same routing, KL 0."""
    backend = _backend(tiny_qwen3_moe_dir, use_rollout_routing_replay=True, use_kl_loss=True,
                       global_batch_size=4)  # two optimizer steps: the first is before any update
    forged = [Sample(**{**s.__dict__, "rollout_routed_experts": (s.rollout_routed_experts + 1) % EXPERTS})
              for s in rollout]
    steps = backend.train([forged[:4], forged[4:]]).steps
    assert steps[0]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    assert steps[1]["train/kl_loss"] != 0.0
