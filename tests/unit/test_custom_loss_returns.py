"""What a ``--loss-type custom_loss`` reads as ``batch["returns"]``: miles' returns (miles' loss.py
hands the loss ``rollout_data["returns"]``, set before the OPD term and before whitening), not the
final advantages. For grpo, gspo and the reinforce_plus_plus estimators they are the unnormalized
advantages; for ppo GAE's returns ``A + V``. Hand-computed values."""

from __future__ import annotations

import pytest
import torch

from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.batches import pack
from miles_disagg.trainer.objective import miles_batch
from miles_disagg.trainer.rollout_inputs import prepare_rollout
from miles_disagg.samples import Sample

CPU = torch.device("cpu")


def grpo_batch():
    samples = [Sample(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -1.0], loss_mask=[1, 1],
                      advantage=1.0, teacher_logprobs=[-0.5, -2.0]),
               Sample(prompt_ids=[1], response_ids=[2, 3, 4], response_logprobs=[-1.0] * 3, loss_mask=[1, 0, 1],
                      advantage=-0.5, teacher_logprobs=[-1.5, -1.0, -0.25])]
    return pack(samples)


@pytest.mark.parametrize("flags", [{"normalize_advantages": True},
                                   {"use_opd": True, "opd_type": "sglang", "opd_kl_coef": 0.5},
                                   {"use_opd": True, "opd_type": "sglang", "normalize_advantages": True}],
                         ids=["whitened", "opd", "opd-whitened"])
def test_grpo_returns_are_the_advantages_before_opd_and_whitening(flags) -> None:
    batch = grpo_batch()
    config = TrainConfig(loss_type="custom_loss", custom_loss_function_path="pkg.loss", **flags)
    frozen = prepare_rollout(config, [[batch]], [torch.full((2, 3), -1.0)], [None]).micro[0]
    data = miles_batch(batch, frozen, CPU)
    assert [r.tolist() for r in data["returns"]] == [[1.0, 1.0], [-0.5, -0.5, -0.5]]
    assert [a.tolist() for a in data["advantages"]] != [[1.0, 1.0], [-0.5, -0.5, -0.5]]  # the final ones differ


def test_ppo_returns_are_gae_returns() -> None:
    """Mask [1, 0, 1], values [0.5, 9.0, 0.2], reward 1.0, gamma 0.9, lambd 0.5 (gamma * lambd 0.45):
    t=2: A = 1 - 0.2 = 0.8, R = 1.0; t=0: delta = 0.9 * 0.2 - 0.5 = -0.32, A = -0.32 + 0.45 * 0.8 = 0.04,
    R = 0.54; token 1 (untrained) 0. The advantages are then whitened; the returns are not."""
    batch = pack([Sample(prompt_ids=[1], response_ids=[2, 3, 4], response_logprobs=[-1.0] * 3, loss_mask=[1, 0, 1],
                         advantage=1.0)])
    batch.values = torch.tensor([[0.5, 9.0, 0.2]])
    config = TrainConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.5, loss_type="custom_loss",
                         custom_loss_function_path="pkg.loss")
    frozen = prepare_rollout(config, [[batch]], [torch.full((1, 3), -1.0)], [None]).micro[0]
    data = miles_batch(batch, frozen, CPU)
    assert data["returns"][0].tolist() == pytest.approx([0.54, 0.0, 1.0], abs=1e-6)
    assert data["advantages"][0].tolist() == pytest.approx([0.04, 0.0, 0.8], abs=1e-6)
    whitened = prepare_rollout(TrainConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.5, normalize_advantages=True),
                               [[batch]], [torch.full((1, 3), -1.0)], [None]).micro[0]
    assert whitened.returns[0].tolist() == pytest.approx([0.54, 0.0, 1.0], abs=1e-6)


def test_without_advantages_there_are_no_returns() -> None:
    config = TrainConfig(loss_type="custom_loss", custom_loss_function_path="pkg.loss",
                         disable_compute_advantages_and_returns=True)
    batch = grpo_batch()
    frozen = prepare_rollout(config, [[batch]], [torch.full((2, 3), -1.0)], [None]).micro[0]
    data = miles_batch(batch, frozen, CPU)
    assert "returns" not in data and "advantages" not in data
