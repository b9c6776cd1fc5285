"""Forward/backward passes of the megatron backend: per-token logprobs and the RL loss per micro-batch.

Both drivers speak megatron's schedule contract: ``forward_step(data_iterator, model)``
returns the stage's output and a loss function; on the last pipeline stage the loss
function returns ``(loss, metrics)`` and the driver backpropagates
``loss * cp_size / num_microbatches``. Without pipeline parallelism a plain loop drives the
micro-batches (megatron's own schedules allocate CUDA tensors, so this loop is also what
runs on CPU); with it, megatron's pipelined schedule does (GPU only).

Scaling: each micro-batch's loss is its sum form (``losses.masked_sum``: the sum of its
samples' token means, or of its trained tokens with ``--calculate-per-token-loss``) divided
by the optimizer step's GLOBAL sample (or token) count over the data-parallel replicas and
multiplied by the data-parallel size, since gradients are averaged over replicas: the
result is the mean over the whole global batch, whatever the number of replicas. It is
pre-multiplied by ``num_microbatches / cp_size`` to cancel the schedule's factor. (Every CP
rank computes the whole sequence's loss from gathered logprobs; the gather's backward sums
the CP ranks' gradients, which the average over data- and context-parallel ranks undoes.)
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from miles_disagg.trainer.losses import token_logprobs_and_entropy
from miles_disagg.trainer.megatron.batching import MicroBatch, causal_mask, cp_merge, cp_split
from miles_disagg.trainer.megatron.model import ParallelLayout
from miles_disagg.trainer.objective import TrainObjective
from miles_disagg.trainer.rollout_inputs import FrozenInputs

LossFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, dict]]


@dataclass
class PassContext:
    """What every forward pass of this rank needs to know."""

    layout: ParallelLayout
    device: torch.device
    temperature: float
    explicit_mask: bool  # megatron's local layers need the causal mask passed in


def run_micro_batches(model: torch.nn.Module, micro_batches: Sequence[MicroBatch], ctx: PassContext,
                      loss_fn: LossFn, *, forward_only: bool, no_sync: Callable | None = None,
                      routing=None, count_routing: bool = False) -> list[dict]:
    """Forward (and unless ``forward_only`` backward) every micro-batch; returns the loss
    functions' metric dicts on the last pipeline stage, ``[]`` elsewhere (collective over PP).
    ``routing``: the model's ``moe.RoutingControl`` (MoE), told each micro-batch's routed experts."""
    def forward_step(data_iterator, model):
        index = next(data_iterator)
        if routing is not None:
            routing.begin(micro_batches[index].routing, training=not forward_only, count=count_routing)
        return _stage_forward(model, micro_batches[index], ctx), functools.partial(loss_fn, index)

    try:
        if ctx.layout.pp_size > 1:
            from megatron.core.pipeline_parallel import get_forward_backward_func

            first = micro_batches[0]
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(range(len(micro_batches))), model=[model],
                num_microbatches=len(micro_batches), seq_length=first.seq_len,  # the schedule divides by CP (and TP with SP)
                micro_batch_size=first.packed.input_ids.shape[0], forward_only=forward_only)
        if routing is not None and not forward_only:
            from miles_disagg.trainer.megatron.moe import set_aux_loss_scale

            set_aux_loss_scale(len(micro_batches))
        return _plain_loop(forward_step, model, len(micro_batches), ctx.layout.cp_size, forward_only, no_sync,
                           routing.backward if routing is not None else contextlib.nullcontext)
    finally:
        if routing is not None:
            routing.end()


def _plain_loop(forward_step, model, num_microbatches: int, cp_size: int, forward_only: bool,
                no_sync: Callable | None, backward_context: Callable = contextlib.nullcontext) -> list[dict]:
    outputs = []
    indices = iter(range(num_microbatches))
    for i in range(num_microbatches):
        last = i == num_microbatches - 1
        context = no_sync() if (no_sync is not None and not last and not forward_only) else contextlib.nullcontext()
        with context:
            output, loss_func = forward_step(indices, model)
            loss, metrics = loss_func(output)
            if not forward_only:
                with backward_context():
                    (loss * cp_size / num_microbatches).backward()
        outputs.append(metrics)
    return outputs


def _stage_forward(model: torch.nn.Module, mb: MicroBatch, ctx: PassContext) -> torch.Tensor:
    layout = ctx.layout
    input_ids = cp_split(mb.packed.input_ids, layout.cp_size, layout.cp_rank).to(ctx.device)
    positions = torch.arange(mb.seq_len).unsqueeze(0).expand_as(mb.packed.input_ids)
    position_ids = cp_split(positions, layout.cp_size, layout.cp_rank).to(ctx.device)
    mask = causal_mask(mb.seq_len, ctx.device) if ctx.explicit_mask else None
    return model(input_ids, position_ids, mask)


def response_logprobs(logits: torch.Tensor, mb: MicroBatch, ctx: PassContext,
                      with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[batch, response]`` logprobs (and entropies) of the response tokens at the rollout
    temperature, from this CP rank's ``[batch, seq / cp, vocab]`` logits."""
    layout = ctx.layout
    targets = cp_split(mb.targets, layout.cp_size, layout.cp_rank).to(ctx.device)
    logprobs, entropy = token_logprobs_and_entropy(logits.float() / ctx.temperature, targets, with_entropy)
    if layout.cp_size > 1:
        logprobs = _cp_gather(logprobs)
        entropy = _cp_gather(entropy) if entropy is not None else None
    positions = mb.response_positions.to(ctx.device)
    return logprobs.gather(1, positions), (entropy.gather(1, positions) if entropy is not None else None)


def _cp_gather(local: torch.Tensor) -> torch.Tensor:
    """The whole sequence from every CP rank's part; gradients flow back to each part."""
    from megatron.core import parallel_state as ps
    from torch.distributed.nn.functional import all_gather

    return cp_merge(list(all_gather(local.contiguous(), group=ps.get_context_parallel_group())))


def logprob_loss_fn(micro_batches: Sequence[MicroBatch], ctx: PassContext) -> LossFn:
    """A loss function that only records each micro-batch's response logprobs (forward-only passes)."""
    def loss_fn(index: int, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        logprobs, _ = response_logprobs(output, micro_batches[index], ctx, with_entropy=False)
        return logprobs.sum() * 0.0, {"logprobs": logprobs.detach()}

    return loss_fn


@dataclass
class StepInputs:
    """One optimizer step's micro-batches with their frozen inputs (behaviour, recomputed and
    reference logprobs, per-token advantages: ``rollout_inputs.FrozenInputs``; None off the last
    stage), and the step's global denominator (samples or trained tokens)."""

    micro_batches: list[MicroBatch]
    frozen: list[FrozenInputs | None]
    denominator: float


def policy_loss_fn(step: StepInputs, objective: TrainObjective, ctx: PassContext) -> LossFn:
    """The ``--loss-type`` loss of one micro-batch (``objective.TrainObjective``), scaled as the module
    docstring says; metrics are this micro-batch's sums."""
    num_microbatches = len(step.micro_batches)
    scale = ctx.layout.dp_size / step.denominator * num_microbatches / ctx.layout.cp_size

    def loss_fn(index: int, output: torch.Tensor) -> tuple[torch.Tensor, dict]:
        mb = step.micro_batches[index]
        logprobs = entropy = None
        if not objective.needs_logits:
            logprobs, entropy = response_logprobs(output, mb, ctx, with_entropy=True)
        loss, metrics = objective(mb.packed, step.frozen[index], logprobs, entropy, output, ctx.device)
        return loss * scale, metrics

    return loss_fn
