"""The fsdp backend on a CUDA device (FSDP2 ``fully_shard``, nccl, bf16 compute).

GPU-only: skipped with a reason where no CUDA device is present. The CPU path of the same
backend (gloo data parallelism) runs in tests/integration/test_trainer_group.py and the e2e runs.
"""

from __future__ import annotations

import math

import pytest
import torch
from checkpoint_reading import assert_same_state, read_state

from miles_disagg.config.components import TrainConfig
from miles_disagg.samples import Sample

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)"),
]


def test_fsdp2_step_and_export_on_one_gpu(tiny_qwen3_dir, monkeypatch) -> None:
    import torch.distributed as dist
    from safetensors import safe_open

    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.fsdp import FSDPBackend

    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        backend = FSDPBackend(TrainConfig(lr=1e-2, global_batch_size=4, micro_batch_size=2), str(tiny_qwen3_dir),
                              rank=0, world_size=1)
        batch = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], response_logprobs=[-4.6] * 3,
                        advantage=float(i % 2) - 0.5) for i in range(4)]
        result = backend.train([batch])
        assert result.steps[0]["train/ppo_kl"] == pytest.approx(0.0, abs=1e-3)  # bf16 compute
        exported = dict(backend.named_tensors())
        with safe_open(str(next(tiny_qwen3_dir.glob("*.safetensors"))), "pt") as f:
            assert set(exported) == set(f.keys())
            for name in f.keys():
                base = f.get_tensor(name)
                assert exported[name].device.type == "cpu" and exported[name].dtype == base.dtype
                assert exported[name].shape == base.shape
    finally:
        dist.destroy_process_group()


def four_samples() -> list[Sample]:
    return [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10], response_logprobs=[-4.6] * 3,
                   advantage=float(i % 2) - 0.5) for i in range(4)]


def test_fsdp2_checkpoint_reloads_on_gpu_and_on_cpu(tiny_qwen3_dir, tmp_path, monkeypatch) -> None:
    """FSDP2 (DTensor parameters and moments) saves through torch.distributed.checkpoint; a fresh
    FSDP2 backend loads it exactly (a save right after holds the same tensors), and so does the
    unwrapped CPU backend: the layout does not depend on the wrapping."""
    import torch.distributed as dist

    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.fsdp import FSDPBackend

    config = TrainConfig(lr=1e-2, global_batch_size=4, micro_batch_size=2)
    init_distributed(0, 1, "127.0.0.1", free_port())  # nccl
    try:
        trained = FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)
        trained.train([four_samples()])
        trained.save_checkpoint(str(tmp_path / "gpu"))
        weights = {name: t.clone() for name, t in trained.named_tensors()}
        restored = FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)
        restored.load_checkpoint(str(tmp_path / "gpu"))
        assert all(torch.equal(t, weights[name]) for name, t in restored.named_tensors())
        restored.save_checkpoint(str(tmp_path / "gpu-again"))
    finally:
        dist.destroy_process_group()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path: gloo, unwrapped
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        on_cpu = FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)
        assert on_cpu.device.type == "cpu" and on_cpu.model is on_cpu.module
        on_cpu.load_checkpoint(str(tmp_path / "gpu"))
        assert all(torch.equal(t, weights[name]) for name, t in on_cpu.named_tensors())
    finally:
        dist.destroy_process_group()
        monkeypatch.undo()
    saved = read_state(tmp_path / "gpu")
    assert {float(v) for k, v in saved["optimizer"].items() if k.endswith(".step")} == {1.0}
    assert_same_state(saved, read_state(tmp_path / "gpu-again"))


def test_megatron_distributed_optimizer_checkpoint_round_trip(tiny_qwen3_dir, tmp_path) -> None:
    """megatron on GPU (bf16 model, distributed optimizer with fp32 main weights): a save in the
    fully_reshardable form reloads into a fresh backend exactly (a save right after the load holds
    the same tensors and common state), and training goes on from it."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    import torch.distributed as dist

    from miles_disagg.engines.launch import free_port
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.megatron.backend import MegatronBackend

    config = TrainConfig(train_backend="megatron", lr=1e-2, global_batch_size=4, micro_batch_size=2)
    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        trained = MegatronBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)
        trained.train([four_samples()])
        trained.save_checkpoint(str(tmp_path / "saved"))
        weights = {name: t.clone() for name, t in trained.named_tensors()}
        del trained
        restored = MegatronBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1)  # new parallel state
        restored.load_checkpoint(str(tmp_path / "saved"))
        assert all(torch.equal(t, weights[name]) for name, t in restored.named_tensors())
        restored.save_checkpoint(str(tmp_path / "again"))
        result = restored.train([four_samples()])
        assert result.steps[0]["train/grad_norm"] > 0
        assert any(not torch.equal(t, weights[name]) for name, t in restored.named_tensors())
    finally:
        dist.destroy_process_group()
    saved = read_state(tmp_path / "saved")
    assert any("exp_avg" in key for key in saved), sorted(saved)[:20]
    assert_same_state(saved, read_state(tmp_path / "again"))
    common = [torch.load(tmp_path / name / "state" / "common.pt", weights_only=False) for name in ("saved", "again")]
    assert_same_state(common[0], common[1])


def ragged_masked_samples() -> list[Sample]:
    out = []
    for i in range(8):
        length = 2 + (5 * i) % 6
        mask = [0 if (i % 3 == 0 and 0 < t < length - 1) else 1 for t in range(length)]
        out.append(Sample(prompt_ids=[5, 6, 7][: 1 + i % 3], response_ids=[8 + (i + t) % 20 for t in range(length)],
                          response_logprobs=[-4.6] * length, advantage=float(i % 2) - 0.5 + 0.1 * i,
                          loss_mask=mask, reward=float(i % 2)))
    return out


def test_loss_modes_masks_estimators_and_kl_watch_on_one_gpu(tiny_qwen3_dir) -> None:
    """The RL objective on CUDA (FSDP2, bf16 compute): masked tokens get no gradient, the two
    loss modes differ, REINFORCE++ with KL in the reward and whitening trains, and with
    --use-kl-loss --kl-loss-coef 0 the reference is loaded and KL logged."""
    import torch.distributed as dist

    from miles_disagg.engines.launch import free_port
    from miles_disagg.trainer.batches import pack
    from miles_disagg.distributed import init_distributed
    from miles_disagg.trainer.fsdp import FSDPBackend
    from miles_disagg.trainer.policy_gradient import rl_loss

    batch = pack(ragged_masked_samples()[:2])
    logprobs = torch.full(batch.loss_mask.shape, -1.0, device="cuda", requires_grad=True)
    loss, _ = rl_loss(TrainConfig(), batch, logprobs, torch.zeros_like(logprobs), logprobs.detach(), None,
                      batch.advantages.cuda().unsqueeze(-1) * batch.response_mask.cuda(), torch.device("cuda"))
    loss.backward()
    assert bool((logprobs.grad.cpu()[batch.loss_mask == 0] == 0).all())

    init_distributed(0, 1, "127.0.0.1", free_port())
    try:
        def train(**flags):
            config = TrainConfig(lr=1e-3, global_batch_size=4, micro_batch_size=2, **flags)
            return FSDPBackend(config, str(tiny_qwen3_dir), rank=0, world_size=1).train(
                [ragged_masked_samples()[:4], ragged_masked_samples()[4:]])

        per_sample, per_token = train(), train(calculate_per_token_loss=True)
        assert per_sample.steps[0]["train/ppo_kl"] == pytest.approx(0.0, abs=1e-3)
        assert per_sample.steps[0]["train/pg_loss"] != pytest.approx(per_token.steps[0]["train/pg_loss"], abs=1e-4)
        watched = train(use_kl_loss=True, kl_loss_coef=0.0)
        assert abs(watched.steps[0]["train/kl_loss"]) < 1e-2 and "train/kl_loss" in watched.steps[1]
        rpp = train(advantage_estimator="reinforce_plus_plus", kl_coef=0.01, normalize_advantages=True)
        assert all(math.isfinite(s["train/grad_norm"]) and s["train/grad_norm"] > 0 for s in rpp.steps)
    finally:
        dist.destroy_process_group()
