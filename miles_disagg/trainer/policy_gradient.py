"""One micro-batch's policy-gradient loss (``--loss-type policy_loss``), as miles' policy loss assembles it.

In order: the ratio (per token; ``--advantage-estimator gspo``: per sequence, the geometric mean of
its token ratios), the clipped surrogate (``losses.clipped_surrogate``, log-ratios clamped to
[-20, 20]), Off-Policy Sequence Masking (``--use-opsm``), the importance correction against the
engines' logprobs (``--use-tis`` and/or ``--get-mismatch-metrics``: miles' truncated IS, or a
``--custom-tis-function-path``), the reduction (``--custom-pg-loss-reducer-function-path`` for the
policy term), the entropy bonus and the KL loss. Every value is in sum form
(``losses.masked_sum``): the backend divides by the step's global sample (or token) count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from miles_disagg.trainer.loss_hooks import TrainHooks, call_tis
from miles_disagg.trainer.losses import kl_penalty, masked_sum, policy_loss
from miles_disagg.trainer.miles_layout import (
    ParallelState, flatten, padded, per_sample, response_lengths, total_lengths, unflatten,
)


def rl_loss(config, batch, logprobs: torch.Tensor, entropy: torch.Tensor | None, old: torch.Tensor | None,
            ref: torch.Tensor | None, advantages: torch.Tensor, device: torch.device, *,
            recomputed: torch.Tensor | None = None,
            hooks: TrainHooks | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One packed micro-batch's loss and metrics in sum form (every backend uses this).

    ``config``: the ``TrainConfig`` (or miles' ``args``, which has the same names); ``batch``: a
    ``PackedBatch``; ``logprobs``/``entropy``: the current policy's; ``old``: the behaviour logprobs
    the ratio divides by (the engines' with ``--use-rollout-logprobs``; None with
    ``--skip-actor-forward-only``: the current ones, detached, so the ratio is exactly 1);
    ``recomputed``: the trainer's own recomputation of them (miles' ``log_probs``, what TIS
    compares with the engines'; default ``old``); ``ref``: the reference model's (None when not
    loaded); ``advantages``: per token. Metrics are reduced like the loss, over trained tokens.
    ``train/kl_loss`` is reported whenever ``--use-kl-loss`` is on, whatever its coefficient.
    """
    mask = batch.loss_mask.to(device)
    active = mask > 0
    current = logprobs.detach()
    skipped = old is None
    old = current if skipped else old
    train_logprobs = recomputed if recomputed is not None else old
    if advantages is None:
        raise ValueError("the policy loss needs advantages (--disable-compute-advantages-and-returns drops them)")
    adv = advantages.to(device)
    raw_adv = adv.unsqueeze(-1).expand_as(logprobs) if adv.dim() == 1 else adv
    adv = torch.where(active, torch.nan_to_num(raw_adv, nan=0.0, posinf=0.0, neginf=0.0), torch.zeros_like(raw_adv))
    pg = policy_loss(logprobs, old, adv, eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high,
                     eps_clip_c=config.eps_clip_c,
                     sequence_mask=mask if config.advantage_estimator == "gspo" else None)
    zero = torch.zeros((), dtype=pg.per_token.dtype, device=device)
    per_token = torch.where(active, pg.per_token, zero)
    sums: dict[str, torch.Tensor] = {}
    if config.use_opsm:
        keep, sums["train/opsm_clipfrac"] = opsm_keep_mask(pg.ppo_kl if config.advantage_estimator == "gspo" else None,
                                                           logprobs, old, raw_adv, batch, mask, config.opsm_delta)
        per_token = per_token * keep
    kept = mask
    if config.use_tis or config.get_mismatch_metrics:
        correction = importance_correction(config, batch, per_token, train_logprobs, current, mask, hooks)
        per_token, kept = correction.per_token, correction.kept
        for key, values in correction.metrics.items():  # over the tokens before any rejection, as miles
            sums[f"train/{key}"] = values if values.dim() == 0 else masked_sum(values, mask, per_token=config.calculate_per_token_loss)
        sums["train/ois"] = masked_sum(torch.exp(-pg.ppo_kl), mask, per_token=config.calculate_per_token_loss)

    def reduce(values: torch.Tensor) -> torch.Tensor:
        return masked_sum(values, kept, per_token=config.calculate_per_token_loss, denominator_mask=mask)

    pg_loss = reduce_policy_term(config, batch, per_token, kept, mask, hooks)
    loss = pg_loss
    sums.update({"train/pg_loss": pg_loss, "train/pg_clipfrac": reduce(pg.clipped),
                 "train/ppo_kl": reduce(torch.where(active, pg.ppo_kl, zero))})
    if entropy is not None:
        sums["train/entropy"] = reduce(entropy)
        if config.entropy_coef != 0:
            loss = loss - config.entropy_coef * sums["train/entropy"]
    if config.use_kl_loss:
        sums["train/kl_loss"] = kl_loss = reduce(kl_term(config, logprobs, old, ref, active))
        if config.kl_loss_coef != 0:
            loss = loss + config.kl_loss_coef * kl_loss
    if skipped and not config.use_rollout_logprobs:  # no frozen pass: miles measures the mismatch here
        diff = (current - batch.rollout_logprobs.to(device)).abs()
        sums["train/train_rollout_logprob_abs_diff"] = masked_sum(diff, mask, per_token=config.calculate_per_token_loss)
    sums["train/loss"] = loss
    return loss, as_floats(sums)


def kl_term(config, logprobs: torch.Tensor, old: torch.Tensor, ref: torch.Tensor | None,
            active: torch.Tensor) -> torch.Tensor:
    """Per-token ``--kl-loss-type`` estimate of the policy from the reference (0 off the trained
    tokens); ``--use-unbiased-kl`` weighs it by ``exp(logprob - old logprob)``."""
    if ref is None:
        raise ValueError("--use-kl-loss needs the reference model's logprobs")
    ratio = torch.exp(logprobs - old) if config.use_unbiased_kl else None
    kl = kl_penalty(logprobs, ref.to(logprobs.device), config.kl_loss_type, ratio)
    return torch.where(active, torch.nan_to_num(kl, nan=0.0, posinf=0.0, neginf=0.0), torch.zeros_like(kl))


def as_floats(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Scalar tensors (or numbers) -> floats, with one device synchronisation."""
    keys = list(sums)
    values = [v.detach().reshape(()).double() if torch.is_tensor(v) else torch.tensor(float(v), dtype=torch.float64)
              for v in sums.values()]
    if not values:
        return {}
    device = next((v.device for v in values if v.device.type != "cpu"), torch.device("cpu"))
    return dict(zip(keys, torch.stack([v.to(device) for v in values]).tolist()))


def opsm_keep_mask(sequence_kl: torch.Tensor | None, logprobs: torch.Tensor, old: torch.Tensor,
                   advantages: torch.Tensor, batch, mask: torch.Tensor,
                   delta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-Policy Sequence Masking (``--use-opsm``), miles' ``compute_opsm_mask``: a response token
    is dropped (0) when its advantage is negative and its sample's mean ``old - new`` over the
    trained tokens exceeds ``--opsm-delta``. Also the metric's sum form: each sample's dropped
    response tokens over its trained tokens (clamped at 1), summed over samples."""
    if sequence_kl is None:
        weights = mask.to(logprobs.dtype)
        per_sample = ((old - logprobs) * weights).sum(dim=-1) / weights.sum(dim=-1).clamp(min=1)
        sequence_kl = per_sample.unsqueeze(-1).expand_as(logprobs)
    response = batch.response_mask.to(mask.device) > 0
    dropped = ((advantages < 0) & (sequence_kl.detach() > delta) & response).to(logprobs.dtype)
    clipfrac = (dropped.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()
    return 1.0 - dropped, clipfrac


@dataclass
class Correction:
    """The importance correction's result: the corrected per-token loss, the tokens kept (a TIS
    function may reject some: ``loss_masks`` it returns), and per-token metric tensors."""

    per_token: torch.Tensor
    kept: torch.Tensor
    metrics: dict[str, torch.Tensor]


def importance_correction(config, batch, per_token: torch.Tensor, train_logprobs: torch.Tensor,
                          current: torch.Tensor, mask: torch.Tensor, hooks: TrainHooks | None) -> Correction:
    """miles' correction for the engines' sampling policy: ``--custom-tis-function-path``'s function
    when given, else truncated IS (``w = clamp(exp(recomputed - engine), tis_clip_low, tis_clip)``,
    detached, multiplying each token's loss; metrics ``tis`` (the ratio before the clamp),
    ``tis_clipfrac``, ``tis_abs`` (``|ratio - 1|``) and this project's ``tis_weight_mean``)."""
    rollout = batch.rollout_logprobs.to(per_token.device)
    if hooks is not None and hooks.tis is not None:
        return custom_correction(hooks.tis, config, batch, per_token, train_logprobs, current, rollout, mask)
    ratio = torch.exp(train_logprobs - rollout).detach()
    weights = ratio.clamp(min=config.tis_clip_low, max=config.tis_clip)
    metrics = {"tis": ratio, "tis_clipfrac": (weights != ratio).to(ratio.dtype), "tis_abs": (ratio - 1).abs(),
               "tis_weight_mean": weights}
    return Correction(per_token * weights, mask, metrics)


def custom_correction(fn, config, batch, per_token: torch.Tensor, train_logprobs: torch.Tensor,
                      current: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> Correction:
    """Call a miles TIS function in miles' layout and bring its answer back to ``[batch, response]``."""
    lengths, width = response_lengths(batch), per_token.shape[-1]
    pg_loss, masks, metrics = call_tis(
        fn, config, pg_loss=flatten(per_token, lengths), train_log_probs=per_sample(train_logprobs, lengths),
        rollout_log_probs=per_sample(rollout, lengths), loss_masks=per_sample(mask, lengths),
        total_lengths=total_lengths(batch), response_lengths=lengths, parallel_state=ParallelState(),
        max_seq_lens=None, cur_log_probs=per_sample(current, lengths))
    kept = padded([m.to(mask.dtype).to(mask.device) for m in masks], width) * mask
    per_metric = {}
    for key, value in (metrics or {}).items():
        value = torch.cat([v.reshape(-1) for v in value]) if isinstance(value, (list, tuple)) else value
        per_metric[key] = value.reshape(()) if value.numel() == 1 and value.dim() == 0 else \
            unflatten(value.to(per_token.dtype).detach(), lengths, width)
    return Correction(unflatten(pg_loss, lengths, width), kept, per_metric)


def reduce_policy_term(config, batch, per_token: torch.Tensor, kept: torch.Tensor, mask: torch.Tensor,
                       hooks: TrainHooks | None) -> torch.Tensor:
    """The policy term in sum form: a ``--custom-pg-loss-reducer-function-path`` reducer (given the
    kept tokens' masks) over miles' flat layout, else each sample's mean over its trained tokens."""
    per_token_loss = config.calculate_per_token_loss
    if hooks is None or hooks.pg_loss_reducer is None:
        return masked_sum(per_token, kept, per_token=per_token_loss, denominator_mask=mask)
    lengths = response_lengths(batch)
    reducer = hooks.pg_loss_reducer(total_lengths(batch), lengths, per_sample(kept, lengths), per_token_loss)
    return reducer(flatten(per_token, lengths))
