"""What one micro-batch's loss is (miles' ``--loss-type``), for every backend.

- ``policy_loss``: the policy-gradient loss (:func:`miles_disagg.trainer.policy_gradient.rl_loss`; with
  ``--use-opd`` the teacher's term is in the advantages, and ``train/opd_reverse_kl`` is logged);
- ``sft_loss``: miles' supervised loss, minus the mean logprob of the trained tokens
  (per sample, or per token with ``--calculate-per-token-loss``);
- ``custom_loss``: ``--custom-loss-function-path``'s function, called as miles calls it with
  miles' ``args``, ``batch`` (:func:`miles_batch`), ``[1, T, vocab]`` logits and
  ``sum_of_sample_mean``; its metrics are logged as ``train/<name>``.

Every loss comes back in sum form; the backend divides by the step's global sample (or
token) count and averages gradients over the data-parallel ranks, as for the built-in loss.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from miles_disagg.trainer import opd
from miles_disagg.trainer.losses import masked_sum
from miles_disagg.trainer.miles_layout import (
    ParallelState, per_sample, response_lengths, sample_mean_reducer, thd_logits, total_lengths, unconcat_tokens,
)
from miles_disagg.trainer.miles_loss_api import load_hooks
from miles_disagg.trainer.policy_gradient import as_floats, rl_loss
from miles_disagg.trainer.rollout_inputs import FrozenInputs


def miles_train_args(config, temperature: float = 1.0) -> argparse.Namespace:
    """miles' ``args`` as a loss function reads them: every ``TrainConfig`` field under its miles
    name, plus what miles derives (``eps_clip_high`` resolved, ``rollout_temperature``, the
    positive forms of the ``--disable-*`` flags, ``qkv_format`` "thd")."""
    args = argparse.Namespace(**dataclasses.asdict(config))
    args.eps_clip_high = config.eps_clip if config.eps_clip_high is None else config.eps_clip_high
    args.rollout_temperature = temperature
    args.qkv_format = "thd"
    args.compute_advantages_and_returns = not config.disable_compute_advantages_and_returns
    args.grpo_std_normalization = not config.disable_grpo_std_normalization
    args.rewards_normalization = not config.disable_rewards_normalization
    args.use_critic = config.advantage_estimator == "ppo"
    args.recompute_loss_function = False
    return args


class TrainObjective:
    """The ``--loss-type`` of a ``TrainConfig``, its hooks loaded (and signature-checked) once."""

    def __init__(self, config, temperature: float = 1.0):
        self.config = config
        self.args = miles_train_args(config, temperature)
        self.hooks = load_hooks(config)

    @property
    def needs_logits(self) -> bool:
        """Whether the loss reads the logits themselves (a custom loss), not only the logprobs."""
        return self.config.loss_type == "custom_loss"

    def __call__(self, batch, frozen: FrozenInputs, logprobs: torch.Tensor | None, entropy: torch.Tensor | None,
                 logits: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
        """One micro-batch's loss in sum form and its metrics (sums, like the loss). ``logits``:
        ``[batch, seq, vocab]``, needed for a custom loss only."""
        loss_type = self.config.loss_type
        if loss_type == "policy_loss":
            loss, metrics = rl_loss(self.args, batch, logprobs, entropy, frozen.old, frozen.ref, frozen.advantages,
                                    device, recomputed=frozen.recomputed, hooks=self.hooks)
            return loss, {**metrics, **opd.metrics(self.config, batch, frozen.opd_reverse_kl, device)}
        if loss_type == "sft_loss":
            loss = -masked_sum(logprobs, batch.loss_mask.to(device), per_token=self.config.calculate_per_token_loss)
            return loss, as_floats({"train/loss": loss})
        if loss_type == "custom_loss":
            return self.custom_loss(batch, frozen, logits, device)
        raise ValueError(f"unknown --loss-type {loss_type!r}")

    def custom_loss(self, batch, frozen: FrozenInputs, logits: torch.Tensor,
                    device: torch.device) -> tuple[torch.Tensor, dict[str, float]]:
        lengths = response_lengths(batch)
        data = miles_batch(batch, frozen, device)
        reducer = sample_mean_reducer(lengths, data["loss_masks"], self.config.calculate_per_token_loss)
        fn = self.hooks.custom_loss
        thd = thd_logits(logits, batch)
        if self.hooks.custom_loss_takes_parallel_state:
            answer = fn(self.args, ParallelState(), data, thd, reducer)
        else:
            answer = fn(self.args, data, thd, reducer)
        if not (isinstance(answer, tuple) and len(answer) == 2 and torch.is_tensor(answer[0])):
            raise ValueError("--custom-loss-function-path: expected (loss tensor, metrics dict), got "
                             f"{type(answer).__name__}")
        loss, metrics = answer
        sums = {f"train/{key}": value.sum() if torch.is_tensor(value) else value for key, value in (metrics or {}).items()}
        sums.setdefault("train/loss", loss)
        return loss, as_floats(sums)


def miles_batch(batch, frozen: FrozenInputs, device: torch.device) -> dict:
    """A ``PackedBatch`` and its frozen inputs as miles' ``RolloutBatch``: per-sample lists over each
    response (``loss_masks``, ``advantages``, ``returns`` (miles': before the OPD term and whitening,
    ``rollout_inputs.FrozenInputs.returns``), ``log_probs`` (the trainer's recomputed;
    absent when that pass is skipped), ``ref_log_probs`` (with a reference), ``rollout_log_probs``),
    ``unconcat_tokens``, ``total_lengths``, ``response_lengths``, ``rewards`` (each sample's
    post-processed reward, its sequence-level signal), ``teacher_log_probs`` and ``opd_reverse_kl``
    (``--use-opd``) and ``max_seq_lens`` None (thd layout)."""
    lengths = response_lengths(batch)
    data = {
        "unconcat_tokens": [t.to(device) for t in unconcat_tokens(batch)],
        "total_lengths": total_lengths(batch),
        "response_lengths": lengths,
        "loss_masks": per_sample(batch.loss_mask.to(device), lengths),
        "rollout_log_probs": per_sample(batch.rollout_logprobs.to(device), lengths),
        "rewards": batch.advantages.tolist(),
        "max_seq_lens": None,
    }
    optional = {"log_probs": frozen.recomputed, "ref_log_probs": frozen.ref, "advantages": frozen.advantages,
                "returns": frozen.returns, "teacher_log_probs": batch.teacher_logprobs,
                "opd_reverse_kl": frozen.opd_reverse_kl}
    for key, values in optional.items():
        if values is not None:
            data[key] = per_sample(values.to(device), lengths)
    return data
