"""The megatron backend with a Qwen3-MoE (4 experts, top 2, one dense layer) on real Ray, gloo, CPU.

- HF -> Megatron -> HF is byte-exact for the MoE checkpoint with expert parallelism 1 and 2
  (experts gathered from their EP rank), and the loaded model's logits are transformers'.
- On the same batch, one GRPO step with EP=2 over 2 ranks (all-to-all dispatcher over gloo)
  gives EP=1's loss, gradient norm and updated weights (float tolerance).
- The FSDP backend (transformers' Qwen3MoeForCausalLM) on the same batch gives the same loss,
  gradient norm and updated weights as Megatron EP=1 and EP=2 (its export may still use
  transformers 5's fused in-memory expert names; they are unfused here to compare).
- Distributed checkpointing: an EP=2 save resumes under EP=1 exactly.
- Routing replay: with ``--use-rollout-routing-replay`` the experts the trainer uses are the
  engine's for every trained token (``train/routing_replay_match`` 1.0) although the router
  itself disagrees (``train/routing_agreement`` < 1); replaying the router's own routing
  changes no logprob, replaying other experts does; ``--use-routing-replay`` with full
  recomputation trains as without recomputation, every recomputed router taking the experts its
  forward used.

The checkpoint is made with transformers' ``Qwen3MoeForCausalLM.save_pretrained`` (the
on-disk names the engines read).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'miles-disagg[megatron]')")

from miles_disagg.config.components import TrainConfig, WeightUpdateConfig  # noqa: E402
from miles_disagg.samples import Sample  # noqa: E402

pytestmark = pytest.mark.timeout(400)

from tiny_moe import EXPERTS, LAYERS, TOPK, make_tiny_moe  # noqa: E402


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("tiny-moe") / "model")


@pytest.fixture(scope="module")
def pool():
    """Trainer rank processes on a private Ray, hosting every group of the module in turn."""
    from rank_pool import private_ray_pool

    with private_ray_pool() as ranks:
        yield ranks


def samples(n: int = 8, routed: bool = False) -> list[Sample]:
    """Varied lengths, one masked tool token every third sample; with ``routed``, engine routing
    that names experts 2 and 3 for every token of every sparse layer (-1 for the dense one)."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        prompt = torch.randint(3, 20, (3 + i % 3,), generator=generator).tolist()
        response = torch.randint(3, 20, (4 + i % 2,), generator=generator).tolist()
        mask = [0 if (i % 3 == 0 and t == 1) else 1 for t in range(len(response))]
        sample = Sample(prompt_ids=prompt, response_ids=response, response_logprobs=[-3.0] * len(response),
                        advantage=float(i % 2) - 0.5 + 0.1 * i, loss_mask=mask)
        if routed:
            sample.rollout_routed_experts = engine_routing(len(prompt) + len(response) - 1)
        out.append(sample)
    return out


def engine_routing(positions: int) -> np.ndarray:
    routing = np.tile(np.array([3, 2], dtype=np.int32), (positions, LAYERS, 1))
    routing[:, 1] = -1  # the dense layer
    return routing


@contextmanager
def trainer_group(pool, model_dir: Path, world_size: int, **train_flags):
    """A set-up TrainerGroup of ``world_size`` of the pool's ranks (released on exit)."""
    from miles_disagg.config.actors import TrainerGroupConfig

    flags = {"lr": 1e-2, "global_batch_size": 8, "micro_batch_size": 2, "seed": 0, **train_flags}
    with pool.group(world_size, TrainerGroupConfig(train=TrainConfig(**flags), weights=WeightUpdateConfig(),
                                                   hf_dir=str(model_dir))) as group:
        yield group


def checkpoint_bytes(model_dir: Path) -> dict[str, bytes]:
    from safetensors.torch import load_file

    return {name: t.contiguous().view(torch.uint8).numpy().tobytes()
            for name, t in load_file(str(model_dir / "model.safetensors")).items()}


def as_tensors(raw: dict[str, bytes]) -> dict[str, torch.Tensor]:
    return {name: torch.frombuffer(bytearray(data), dtype=torch.float32) for name, data in raw.items()}


def one_step(pool, model_dir: Path, world_size: int, routed: bool = False, **flags) -> dict:
    with trainer_group(pool, model_dir, world_size, **flags) as group:
        before = group.tensor_bytes()
        result = group.train(samples(routed=routed))
        return {"before": before, "metrics": result.steps[0], "after": group.tensor_bytes()}


# Adam's first step with eps 1 moves each weight by about its gradient (g / (|g| + 1)), so comparing
# weights after the step compares gradients (with eps 1e-8 it would move by ~lr * sign(g)).
PARITY = {"lr": 1.0, "adam_eps": 1.0, "clip_grad": 0.0}


@pytest.fixture(scope="module")
def ep_runs(pool, tiny_moe_dir: Path) -> dict:
    return {"ep1": one_step(pool, tiny_moe_dir, 1, **PARITY),  # megatron's allgather dispatcher (one rank)
            "ep2": one_step(pool, tiny_moe_dir, 2, expert_model_parallel_size=2, **PARITY)}  # alltoall (default, EP > 1)


def test_hf_megatron_hf_is_byte_exact_for_ep1_and_ep2(ep_runs: dict, tiny_moe_dir: Path) -> None:
    base = checkpoint_bytes(tiny_moe_dir)
    assert sum(".mlp.experts." in name for name in base) == 2 * EXPERTS * 3  # on-disk names, both sparse layers
    for run in ("ep1", "ep2"):
        exported = ep_runs[run]["before"]
        assert set(exported) == set(base), run
        for name, data in base.items():
            assert exported[name] == data, (run, name)


def test_ep2_step_matches_ep1(ep_runs: dict) -> None:
    one, two = ep_runs["ep1"], ep_runs["ep2"]
    for key in ("train/loss", "train/pg_loss", "train/entropy", "train/grad_norm"):
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    after_one, after_two = as_tensors(one["after"]), as_tensors(two["after"])
    changed = [name for name in after_one if not torch.equal(after_one[name], as_tensors(one["before"])[name])]
    assert any(".mlp.experts." in name for name in changed) and any(".mlp.gate." in name for name in changed)
    for name, tensor in after_one.items():
        torch.testing.assert_close(after_two[name], tensor, rtol=1e-4, atol=1e-5)


def on_disk_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers 5's fused experts (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``down_proj``
    ``[E, H, I]``) as the checkpoint's per-expert tensors; other names as they are."""
    out = {}
    for name, tensor in tensors.items():
        prefix, _, last = name.rpartition(".")
        if prefix.endswith("mlp.experts") and last == "gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
        elif prefix.endswith("mlp.experts") and last == "down_proj":
            for e, down in enumerate(tensor):
                out[f"{prefix}.{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out


def fsdp_tensors(raw: dict[str, bytes], shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    return on_disk_names({name: torch.frombuffer(bytearray(data), dtype=torch.float32).view(shapes[name])
                          for name, data in raw.items()})


def test_fsdp_step_matches_megatron(pool, ep_runs: dict, tiny_moe_dir: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    fsdp = one_step(pool, tiny_moe_dir, 1, train_backend="fsdp", **PARITY)
    for key in ("train/loss", "train/entropy", "train/grad_norm"):
        assert fsdp["metrics"][key] == pytest.approx(ep_runs["ep1"]["metrics"][key], rel=1e-4, abs=1e-6), key
    shapes = {n: tuple(p.shape) for n, p in AutoModelForCausalLM.from_pretrained(str(tiny_moe_dir)).state_dict().items()}
    with safe_open(str(tiny_moe_dir / "model.safetensors"), "pt") as f:
        shapes.update({n: tuple(f.get_slice(n).get_shape()) for n in f.keys()})
    before, after = fsdp_tensors(fsdp["before"], shapes), fsdp_tensors(fsdp["after"], shapes)
    for name, tensor in as_tensors(ep_runs["ep1"]["before"]).items():
        assert torch.equal(before[name].flatten(), tensor), name  # the same starting point
    for run in ("ep1", "ep2"):
        for name, tensor in as_tensors(ep_runs[run]["after"]).items():
            torch.testing.assert_close(after[name].flatten(), tensor, rtol=1e-4, atol=1e-5)


def test_rollout_routing_replay_uses_the_engine_experts(pool, tiny_moe_dir: Path) -> None:
    free = one_step(pool, tiny_moe_dir, 2, routed=True, expert_model_parallel_size=2)["metrics"]
    replayed = one_step(pool, tiny_moe_dir, 2, routed=True, expert_model_parallel_size=2,
                        use_rollout_routing_replay=True)["metrics"]
    assert "train/routing_replay_match" not in free
    assert 0.0 <= free["train/routing_agreement"] < 1.0  # the random router does not always pick {2, 3}
    assert replayed["train/routing_replay_match"] == 1.0  # every trained (token, sparse layer) used {2, 3}
    for key in ("train/entropy", "train/grad_norm"):  # (the first on-policy step's loss is -mean advantage)
        assert replayed[key] != pytest.approx(free[key], rel=1e-6), key


def replay_logprobs(model_dir: str) -> dict:
    """In a fresh process: response logprobs with free routing, replaying the router's own
    routing (recorded from the free pass), and replaying experts {2, 3}; and the routing used."""
    import torch.distributed as dist

    from miles_disagg.distributed import init_distributed
    from miles_disagg.engines.launch import free_port
    from miles_disagg.trainer.megatron.backend import MegatronBackend
    from miles_disagg.trainer.megatron.batching import make_micro_batch

    init_distributed(0, 1, "127.0.0.1", free_port())
    backend = MegatronBackend(TrainConfig(train_backend="megatron", use_rollout_routing_replay=True, seed=0),
                              model_dir, rank=0, world_size=1)
    batch = samples(4)
    control = backend.routing[id(backend.gpt)]
    recorded = {}

    def logprobs(with_routing: list[Sample]) -> torch.Tensor:
        mb = make_micro_batch(with_routing, backend.pad_id, 1, (LAYERS, TOPK, EXPERTS))
        taps_used = []
        for tap in control.taps:
            original = tap.get_replay_topk

            def spy(*args, tap=tap, original=original, **kwargs):
                probs, used = original(*args, **kwargs)
                taps_used.append((tap.layer, used.clone()))
                return probs, used
            tap.get_replay_topk = spy
        try:
            out = backend._frozen_logprobs(backend.gpt, [mb])[0]
        finally:
            for tap in control.taps:
                del tap.get_replay_topk
        recorded["used"] = taps_used
        return out

    free = logprobs(batch)
    own = {layer: used for layer, used in recorded["used"]}  # [seq * batch, k] in megatron's token order
    seq = max(len(s.prompt_ids) + len(s.response_ids) for s in batch)
    for i, sample in enumerate(batch):
        positions = len(sample.prompt_ids) + len(sample.response_ids) - 1
        routing = np.full((positions, LAYERS, TOPK), -1, dtype=np.int32)
        for layer, used in own.items():
            routing[:, layer] = used.view(seq, len(batch), TOPK)[:positions, i].numpy()
        sample.rollout_routed_experts = routing
    same = logprobs(batch)
    for sample in batch:
        sample.rollout_routed_experts = engine_routing(len(sample.prompt_ids) + len(sample.response_ids) - 1)
    forced = logprobs(batch)
    used_forced = {layer: used.view(seq, len(batch), TOPK) for layer, used in recorded["used"]}
    dist.destroy_process_group()
    return {"free": free, "same": same, "forced": forced, "used_forced": used_forced,
            "lengths": [len(s.prompt_ids) + len(s.response_ids) for s in batch]}


def test_replaying_the_routers_own_choice_changes_nothing_and_forced_experts_are_used(
        pool, tiny_moe_dir: Path) -> None:
    out = pool.run(replay_logprobs, str(tiny_moe_dir))
    assert torch.equal(out["same"], out["free"])
    assert not torch.allclose(out["forced"], out["free"])
    for layer in (0, 2):
        used = out["used_forced"][layer]
        for i, length in enumerate(out["lengths"]):
            # positions < length - 1 replay {2, 3}; the last real position routes freely
            assert (used[:length - 1, i].sort(dim=-1).values == torch.tensor([2, 3])).all(), (layer, i)


def test_routing_replay_under_full_recompute_trains_as_without(pool, tiny_moe_dir: Path) -> None:
    plain = one_step(pool, tiny_moe_dir, 1, routed=True, use_rollout_routing_replay=True)
    recomputed = one_step(pool, tiny_moe_dir, 1, routed=True, use_rollout_routing_replay=True, use_routing_replay=True,
                          recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    assert recomputed["metrics"]["train/routing_replay_match"] == 1.0
    for key in ("train/entropy", "train/grad_norm"):
        assert recomputed["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-6), key
    for name, tensor in as_tensors(plain["after"]).items():
        torch.testing.assert_close(as_tensors(recomputed["after"])[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def test_an_ep2_save_resumes_under_ep1(pool, tiny_moe_dir: Path, tmp_path: Path) -> None:
    """megatron-core's distributed checkpoint of an EP=2 run (experts split over two ranks) loads
    into one rank exactly, Adam state included (the next step matches the EP=2 run's)."""
    save_dir = str(tmp_path / "save")
    with trainer_group(pool, tiny_moe_dir, 2, expert_model_parallel_size=2) as group:
        group.train(samples())
        group.save(save_dir, with_hf=False)
        saved = group.tensor_bytes()
        next_step = group.train(samples()).steps[0]
    with trainer_group(pool, tiny_moe_dir, 1) as group:
        group.load(save_dir)
        assert group.tensor_bytes() == saved
        resumed = group.train(samples()).steps[0]
    for key in ("train/loss", "train/entropy", "train/grad_norm", "train/ppo_kl"):
        assert resumed[key] == pytest.approx(next_step[key], rel=1e-5, abs=1e-7), key


def recompute_routing_calls(model_dir: str) -> dict:
    """In a fresh process: one step with full recomputation and ``--use-routing-replay``, counting
    per router the forward calls that recorded their experts and the recomputed calls that
    replayed a recorded routing (and whether it was the forward's, for the same micro-batch)."""
    import torch.distributed as dist

    from miles_disagg.distributed import init_distributed
    from miles_disagg.engines.launch import free_port
    from miles_disagg.trainer.megatron.backend import MegatronBackend

    init_distributed(0, 1, "127.0.0.1", free_port())
    config = TrainConfig(train_backend="megatron", use_routing_replay=True, recompute_granularity="full",
                         recompute_method="uniform", recompute_num_layers=1, seed=0, global_batch_size=8,
                         micro_batch_size=2)
    backend = MegatronBackend(config, model_dir, rank=0, world_size=1)
    calls = {"recorded": 0, "replayed": 0, "same": 0}
    for tap in backend.routing[id(backend.gpt)].taps:
        original = tap.get_replay_topk

        def spy(*args, tap=tap, original=original, **kwargs):
            replaying = tap.replay_recorded and bool(tap.recorded)
            expected = tap.recorded[0].clone() if replaying else None
            probs, used = original(*args, **kwargs)
            if replaying:
                calls["replayed"] += 1
                calls["same"] += int(torch.equal(used, expected))
            elif tap.record:
                calls["recorded"] += 1
            return probs, used
        tap.get_replay_topk = spy
    backend.train([samples()])
    dist.destroy_process_group()
    return calls


def test_use_routing_replay_makes_recomputation_replay_the_forward(pool, tiny_moe_dir: Path) -> None:
    calls = pool.run(recompute_routing_calls, str(tiny_moe_dir))
    micro_batches, sparse_layers = 4, 2
    assert calls["recorded"] == micro_batches * sparse_layers  # the training forward only (not the frozen passes)
    assert calls["replayed"] == calls["same"] == calls["recorded"]  # every recomputation took the forward's experts
