"""Samples -> padded tensors for the trainer (the split of a rollout into optimizer steps and ranks' shares:
:mod:`miles_disagg.trainer.shares`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from miles_disagg.trainer.critic_values import values_of
from miles_disagg.samples import Sample


@dataclass
class PackedBatch:
    """Right-padded ``[batch, seq]`` tokens and ``[batch, response]`` per-token fields.

    ``response_mask`` marks each sample's real response tokens (0 on padding); ``loss_mask``
    marks the tokens that are trained: the response tokens whose ``Sample.loss_mask`` is 1
    (tokens the policy did not generate, e.g. tool output, are 0 and get no gradient).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    response_start: torch.Tensor  # index of each sample's first response token in input_ids
    rollout_logprobs: torch.Tensor
    advantages: torch.Tensor  # [batch]: each sample's sequence-level signal (Sample.advantage)
    values: torch.Tensor | None = None
    """PPO: ``[batch, response]`` the critic's value of each response token (0 on padding);
    None unless every sample carries them (``trainer.critic_values``)."""
    teacher_logprobs: torch.Tensor | None = None
    """``--use-opd``: the teacher's logprob of each response token (0 on padding); None when no sample has them."""
    opd_reverse_kl: torch.Tensor | None = None
    """Top-k OPD: each response token's precomputed reverse KL (``Sample.opd_reverse_kl``, 0 on padding);
    None when no sample has it."""

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Trained tokens, each sample's clamped at 1 (the per-token loss's denominator share, as
        miles counts it: a sample with no trained token counts as one)."""
        return int(self.loss_mask.sum(dim=-1).clamp(min=1).sum().item())


def pack(samples: Sequence[Sample], pad_id: int = 0) -> PackedBatch:
    """Pack samples; a sample must have at least one response token, and its ``loss_mask``
    (when given) one 0/1 per response token (``ValueError`` otherwise)."""
    if not samples:
        raise ValueError("cannot pack an empty batch")
    seq_len = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    resp_len = max(len(s.response_ids) for s in samples)
    n = len(samples)
    input_ids = torch.full((n, seq_len), pad_id, dtype=torch.long)
    attention = torch.zeros((n, seq_len), dtype=torch.long)
    response_ids = torch.zeros((n, resp_len), dtype=torch.long)
    response_mask = torch.zeros((n, resp_len), dtype=torch.float32)
    loss_mask = torch.zeros((n, resp_len), dtype=torch.float32)
    rollout_lp = torch.zeros((n, resp_len), dtype=torch.float32)
    for i, s in enumerate(samples):
        if not s.response_ids:
            raise ValueError(f"sample {i} has an empty response")
        tokens = list(s.prompt_ids) + list(s.response_ids)
        input_ids[i, :len(tokens)] = torch.tensor(tokens)
        attention[i, :len(tokens)] = 1
        r = len(s.response_ids)
        response_ids[i, :r] = torch.tensor(s.response_ids)
        response_mask[i, :r] = 1.0
        loss_mask[i, :r] = torch.tensor(_checked_loss_mask(s, i), dtype=torch.float32)
        if s.response_logprobs:
            rollout_lp[i, :r] = torch.tensor(s.response_logprobs[:r], dtype=torch.float32)
    return PackedBatch(
        input_ids=input_ids, attention_mask=attention, response_ids=response_ids, response_mask=response_mask,
        loss_mask=loss_mask, response_start=torch.tensor([len(s.prompt_ids) for s in samples]),
        rollout_logprobs=rollout_lp, advantages=torch.tensor([s.advantage for s in samples], dtype=torch.float32),
        values=_packed_values(samples, resp_len),
        teacher_logprobs=_per_token(samples, resp_len, "teacher_logprobs", "teacher logprobs"),
        opd_reverse_kl=_per_token(samples, resp_len, "opd_reverse_kl", "opd_reverse_kl terms"),
    )


def _packed_values(samples: Sequence[Sample], resp_len: int) -> torch.Tensor | None:
    rows = [values_of(s) for s in samples]
    if any(row is None for row in rows):
        return None
    values = torch.zeros((len(samples), resp_len), dtype=torch.float32)
    for i, row in enumerate(rows):
        values[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
    return values


def _per_token(samples: Sequence[Sample], resp_len: int, name: str, what: str) -> torch.Tensor | None:
    """``[batch, response]`` of the per-token field ``name`` when any sample has it (then every sample
    must, one value per response token: ``ValueError`` otherwise)."""
    rows = [getattr(s, name) for s in samples]
    if all(row is None for row in rows):
        return None
    values = torch.zeros((len(samples), resp_len), dtype=torch.float32)
    for i, (s, row) in enumerate(zip(samples, rows)):
        if row is None or len(row) != len(s.response_ids):
            got = "none" if row is None else len(row)
            raise ValueError(f"sample {i}: {got} {what} for {len(s.response_ids)} response tokens")
        values[i, :len(s.response_ids)] = torch.tensor(row, dtype=torch.float32)
    return values


def _checked_loss_mask(sample: Sample, index: int) -> list[int]:
    mask = sample.trained_mask()
    if len(mask) != len(sample.response_ids):
        raise ValueError(f"sample {index}: loss_mask has {len(mask)} entries for {len(sample.response_ids)} "
                         "response tokens")
    if any(m not in (0, 1) for m in mask):
        raise ValueError(f"sample {index}: loss_mask entries must be 0 or 1")
    return mask


def response_logits(logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """``[batch, seq, vocab]`` logits -> the ``[batch, response, vocab]`` logits that predict each response token."""
    n, resp_len = batch.response_ids.shape
    offsets = torch.arange(resp_len).unsqueeze(0) + batch.response_start.unsqueeze(1) - 1
    offsets = offsets.clamp(max=logits.shape[1] - 1).to(logits.device)
    return logits.gather(1, offsets.unsqueeze(-1).expand(n, resp_len, logits.shape[-1]))
