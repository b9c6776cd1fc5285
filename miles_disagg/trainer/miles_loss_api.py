"""miles' loss API for user loss code, served under miles' import paths when miles is not installed.

A custom loss, TIS function or reducer written for miles imports from ``miles.utils.ppo_utils``,
``miles.backends.megatron_utils.loss`` / ``.cp_utils`` or their newer homes under
``miles.backends.training_utils`` (``loss``, ``loss_hub.*``, ``cp_utils``, ``parallel``).
:func:`serve_miles_loss_modules` registers those modules with the ``miles.*`` finder
(:mod:`miles_disagg.rollout.miles_compat`); the names below behave with miles' meaning, in miles'
layout (:mod:`miles_disagg.trainer.miles_layout`), on this trainer's formulas.

Context parallelism is never seen by a user loss here (it is refused with a custom loss), so the
CP helpers return their input and ``parallel_state`` is trivial.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from miles_disagg.trainer.batches import PackedBatch
from miles_disagg.trainer.loss_hooks import TrainHooks, load_train_hooks
from miles_disagg.trainer.losses import clipped_surrogate, kl_penalty, token_logprobs_and_entropy
from miles_disagg.trainer.miles_layout import ParallelState, padded, sample_mean_reducer
from miles_disagg.trainer.policy_gradient import rl_loss


def get_log_probs_and_entropy(logits: torch.Tensor, *, args, unconcat_tokens: list, total_lengths: list,
                              response_lengths: list, with_entropy: bool = False, non_loss_data: bool = True,
                              max_seq_lens=None, parallel_state=None, entropy_requires_grad: bool = True,
                              **kwargs: Any) -> dict[str, list[torch.Tensor]]:
    """miles': each sample's response-token logprobs (and entropies) from ``[1, T, vocab]`` logits at
    ``args.rollout_temperature``; ``{"log_probs": [...], "entropy": [...]}``."""
    logits = logits.squeeze(0) / args.rollout_temperature
    log_probs, entropies, end = [], [], 0
    for tokens, total, response in zip(unconcat_tokens, total_lengths, response_lengths):
        end += total
        chunk = logits[end - response - 1:end - 1]
        logprob, entropy = token_logprobs_and_entropy(chunk, tokens[-response:].to(chunk.device), with_entropy)
        log_probs.append(logprob)
        entropies.append(entropy if entropy is None or entropy_requires_grad else entropy.detach())
    result = {"log_probs": log_probs}
    if with_entropy:
        result["entropy"] = entropies
    return result


def get_sum_of_sample_mean(total_lengths: list, response_lengths: list, loss_masks: list,
                           calculate_per_token_loss: bool = False, qkv_format: str = "thd", max_seq_lens=None,
                           sample_denoms: list | None = None):
    """miles': the reducer of a flat per-token tensor (each sample's masked mean, summed; or the
    masked sum with ``calculate_per_token_loss``); ``sample_denoms``: each sample's denominator."""
    denominators = None if sample_denoms is None else [torch.tensor(float(d)) for d in sample_denoms]
    return sample_mean_reducer(response_lengths, loss_masks, calculate_per_token_loss, denominators)


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int, *args: Any,
                       **kwargs: Any) -> torch.Tensor:
    """miles': the whole response from the context-parallel parts; here the part is the whole."""
    return tensor


def slice_log_prob_with_cp(tensor, total_length: int, response_length: int, *args: Any, **kwargs: Any):
    """miles': this CP rank's part of a whole response; here the whole."""
    return tensor


def get_parallel_state() -> ParallelState:
    return ParallelState()


def compute_approx_kl(log_probs: torch.Tensor, log_probs_base: torch.Tensor, kl_loss_type: str,
                      importance_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """miles': the per-token KL estimate (``losses.kl_penalty``)."""
    return kl_penalty(log_probs, log_probs_base, kl_loss_type, importance_ratio)


def compute_policy_loss(ppo_kl: torch.Tensor, advantages: torch.Tensor, eps_clip: float, eps_clip_high: float,
                        eps_clip_c: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """miles': per-token clipped surrogate and clip indicator (``losses.clipped_surrogate``)."""
    return clipped_surrogate(ppo_kl, advantages, eps_clip=eps_clip, eps_clip_high=eps_clip_high,
                             eps_clip_c=eps_clip_c)


def compute_gspo_kl(full_log_probs: list, full_old_log_probs: list, local_log_probs: list,
                    loss_masks: list) -> torch.Tensor:
    """miles': each sample's masked mean of ``old - new`` on each of its tokens, flat."""
    parts = [(((old - new) * mask).sum() / mask.sum().clamp(min=1)).expand_as(local)
             for new, old, mask, local in zip(full_log_probs, full_old_log_probs, loss_masks, local_log_probs)]
    return torch.cat(parts, dim=0)


def compute_opsm_mask(args, full_log_probs: list, full_old_log_probs: list, advantages: list,
                      loss_masks: list) -> tuple[torch.Tensor, torch.Tensor]:
    """miles': the flat keep mask of Off-Policy Sequence Masking and its clip-fraction sum."""
    keep, clipfrac = [], torch.zeros(())
    for new, old, advantage, mask in zip(full_log_probs, full_old_log_probs, advantages, loss_masks):
        sequence_kl = ((old - new) * mask).sum() / mask.sum().clamp(min=1)
        dropped = ((advantage < 0) & (sequence_kl > args.opsm_delta)).to(new.dtype)
        clipfrac = clipfrac.to(new.device) + dropped.sum() / mask.sum().clamp(min=1)
        keep.append(1 - dropped)
    return torch.cat(keep, dim=0), clipfrac


def vanilla_tis_function(args, *, pg_loss: torch.Tensor, train_log_probs: list, rollout_log_probs: list,
                         loss_masks: list, **kwargs: Any):
    """miles': truncated IS, ``pg_loss * clamp(exp(train - rollout), tis_clip_low, tis_clip)``."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    weights = ratio.clamp(min=args.tis_clip_low, max=args.tis_clip)
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weights, loss_masks, metrics


def icepop_function(args, *, pg_loss: torch.Tensor, train_log_probs: list, rollout_log_probs: list,
                    loss_masks: list, **kwargs: Any):
    """miles': IS clip-or-pop, a ratio outside ``[tis_clip_low, tis_clip]`` zeroes the token's loss."""
    ratio = torch.exp(torch.cat(train_log_probs) - torch.cat(rollout_log_probs))
    inside = (ratio >= args.tis_clip_low) & (ratio <= args.tis_clip)
    weights = torch.where(inside, ratio, torch.zeros_like(ratio))
    metrics = {"tis": ratio.detach(), "tis_clipfrac": (weights != ratio).float(), "tis_abs": (ratio - 1).abs().detach()}
    return pg_loss * weights, loss_masks, metrics


MILES_METRIC_NAMES = {"entropy": "entropy_loss"}


def policy_loss_function(args, batch: dict, logits: torch.Tensor, sum_of_sample_mean=None):
    """miles': the policy loss of a miles batch, with this trainer's ``rl_loss`` (so a custom loss
    that wraps it trains exactly as ``--loss-type policy_loss``). The reduction is the default one
    of ``args.calculate_per_token_loss`` (``sum_of_sample_mean`` is not consulted)."""
    lengths = list(batch["response_lengths"])
    width = max(lengths)
    out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                    total_lengths=batch["total_lengths"], response_lengths=lengths, with_entropy=True)
    packed = packed_from_miles(batch)
    device = logits.device

    def wide(key: str) -> torch.Tensor | None:
        return padded([t.to(device) for t in batch[key]], width) if batch.get(key) is not None else None

    recomputed = wide("log_probs")
    old = packed.rollout_logprobs.to(device) if args.use_rollout_logprobs else recomputed
    loss, metrics = rl_loss(args, packed, padded(out["log_probs"], width), padded(out["entropy"], width), old,
                            wide("ref_log_probs"), wide("advantages"), device, recomputed=recomputed,
                            hooks=load_hooks(args))
    named = {MILES_METRIC_NAMES.get(key.removeprefix("train/"), key.removeprefix("train/")):
             torch.tensor(value, dtype=torch.float64) for key, value in metrics.items()}
    return loss, named


def sft_loss_function(args, batch: dict, logits: torch.Tensor, sum_of_sample_mean):
    """miles': minus the mean logprob of the trained tokens, reduced by ``sum_of_sample_mean``."""
    out = get_log_probs_and_entropy(logits, args=args, unconcat_tokens=batch["unconcat_tokens"],
                                    total_lengths=batch["total_lengths"], response_lengths=batch["response_lengths"])
    loss = -sum_of_sample_mean(torch.cat(out["log_probs"], dim=0))
    return loss, {"loss": loss.detach()}


def packed_from_miles(batch: dict) -> PackedBatch:
    """A miles batch's samples as a right-padded ``PackedBatch`` (tokens, masks, engine logprobs)."""
    tokens, lengths = batch["unconcat_tokens"], list(batch["response_lengths"])
    width, seq = max(lengths), max(len(t) for t in tokens)
    rollout = batch.get("rollout_log_probs") or [torch.zeros(n) for n in lengths]
    rewards = batch.get("rewards") or [0.0] * len(lengths)
    return PackedBatch(
        input_ids=padded([t.cpu().long() for t in tokens], seq),
        attention_mask=padded([torch.ones(len(t), dtype=torch.long) for t in tokens], seq),
        response_ids=padded([t[-n:].cpu().long() for t, n in zip(tokens, lengths)], width),
        response_mask=padded([torch.ones(n) for n in lengths], width),
        loss_mask=padded([m.float().cpu() for m in batch["loss_masks"]], width),
        response_start=torch.tensor([len(t) - n for t, n in zip(tokens, lengths)]),
        rollout_logprobs=padded([r.float().cpu() for r in rollout], width),
        advantages=torch.tensor([float(r) for r in rewards]))


LOSS_NAMES = ("get_log_probs_and_entropy", "policy_loss_function", "sft_loss_function", "vanilla_tis_function",
              "icepop_function")
CP_NAMES = ("get_sum_of_sample_mean", "all_gather_with_cp", "slice_log_prob_with_cp")
MATH_NAMES = ("compute_approx_kl", "compute_policy_loss", "compute_gspo_kl", "compute_opsm_mask")


def serve_miles_loss_modules() -> None:
    """Register miles' loss modules with the ``miles.*`` finder (idempotent)."""
    from miles_disagg.rollout.miles_compat import install_miles_imports, serve_modules

    here = sys.modules[__name__]
    package = (None, (), True)
    serve_modules({
        "miles.backends": package, "miles.backends.megatron_utils": package,
        "miles.backends.training_utils": package, "miles.backends.training_utils.loss_hub": package,
        "miles.backends.megatron_utils.loss": (here, LOSS_NAMES, False),
        "miles.backends.training_utils.loss": (here, LOSS_NAMES, False),
        "miles.backends.megatron_utils.cp_utils": (here, CP_NAMES, False),
        "miles.backends.training_utils.cp_utils": (here, CP_NAMES, False),
        "miles.backends.training_utils.parallel": (here, ("ParallelState", "get_parallel_state"), False),
        "miles.backends.training_utils.loss_hub.losses": (here, ("policy_loss_function", "sft_loss_function"), False),
        "miles.backends.training_utils.loss_hub.corrections": (here, ("vanilla_tis_function", "icepop_function"),
                                                               False),
        "miles.backends.training_utils.loss_hub.logit_processors": (here, ("get_log_probs_and_entropy",), False),
        "miles.backends.training_utils.loss_hub.math_utils": (here, MATH_NAMES, False),
        "miles.utils.ppo_utils": (here, MATH_NAMES, False),
    })
    install_miles_imports()


def load_hooks(config) -> TrainHooks | None:
    """The loss hooks a ``TrainConfig`` (or miles' ``args``) names, miles' loss modules served first
    so the hooks can import them; None when it names none."""
    paths = (config.custom_loss_function_path, config.custom_tis_function_path,
             config.custom_pg_loss_reducer_function_path)
    if not any(paths):
        return None
    serve_miles_loss_modules()
    return load_train_hooks(config)


__all__ = [*LOSS_NAMES, *CP_NAMES, *MATH_NAMES, "ParallelState", "get_parallel_state", "load_hooks",
           "serve_miles_loss_modules"]
