"""``--train-backend megatron``: a megatron-core GPTModel with tensor, pipeline and context parallelism.

Data: ``TrainerGroup`` deals each global batch round-robin over all ranks; the ranks of one
data-parallel (DP) replica (its TP x CP x PP peers) pool their shares, so every rank of a
replica trains on the same samples and the replicas split the batch. Each optimizer
step's samples become micro-batches of ``--micro-batch-size`` samples, or, with
``--use-dynamic-batch-size``, of at most ``--max-tokens-per-gpu`` padded tokens per GPU.

CPU runs (gloo, float32, megatron's local layers) support TP and DP; PP needs CUDA, CP and
sequence parallelism need CUDA and Transformer Engine (see ``model.check_layout_support``).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from miles_disagg.config.components import TrainConfig
from miles_disagg.trainer.backend import MetricMeans, TrainerBackend
from miles_disagg.trainer.losses import masked_mean
from miles_disagg.trainer.megatron.batching import (
    MicroBatch, fixed_size_batches, make_micro_batch, token_budget_batches)
from miles_disagg.trainer.megatron.export import ExportPlan, export_hf
from miles_disagg.trainer.megatron.model import (
    build_gpt, import_megatron, init_parallel_state, load_hf_weights, read_hf_config, transformer_config,
    uses_te_spec)
from miles_disagg.trainer.megatron.optim import make_optimizer
from miles_disagg.trainer.torch_dist import load_torch_dist, torch_dist_dir
from miles_disagg.trainer.megatron.step import (
    PassContext, StepInputs, logprob_loss_fn, policy_loss_fn, run_micro_batches)
from miles_disagg.types import ConfigError, Sample


class MegatronBackend(TrainerBackend):
    def __init__(self, config: TrainConfig, hf_dir: str, *, rank: int, world_size: int, temperature: float = 1.0,
                 initial_checkpoint: tuple[str, str] | None = None):
        """Build the parallel state, this rank's model stage from ``hf_dir`` (then, given
        ``initial_checkpoint`` ``(path, flag)``, the weights of that Megatron torch_dist
        checkpoint), its optimizer and (``--use-kl-loss`` with a positive coefficient) the frozen
        reference from ``--ref-load`` (HF or torch_dist) or ``hf_dir``. ``temperature``: the
        rollout's, applied to logits before logprobs."""
        import_megatron()
        self.config, self.rank, self.world_size = config, rank, world_size
        self.layout = init_parallel_state(config, world_size)
        hf_config, self.shape = read_hf_config(hf_dir)
        self.shape.check_parallel(self.layout.tp_size, self.layout.pp_size)
        self.pad_id = hf_config.pad_token_id or 0
        self.plan = ExportPlan.build(hf_dir, self.shape, self.layout.pp_size, uses_te_spec())  # fail before building
        torch.manual_seed(config.seed + rank)
        self.tconfig = transformer_config(self.shape, config, self.layout)
        self.gpt = build_gpt(self.shape, self.tconfig, self.layout)
        load_hf_weights(self.gpt, hf_dir, self.shape, self.layout)
        if initial_checkpoint is not None:
            load_torch_dist(self.gpt, *initial_checkpoint)
        self.optim = make_optimizer(self.gpt, config, self.tconfig)
        self.ref = self._reference(config.ref_load or hf_dir) if config.use_kl_loss and config.kl_loss_coef > 0 else None
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.ctx = PassContext(self.layout, device, temperature if temperature > 0 else 1.0,
                               explicit_mask=not uses_te_spec())

    def _reference(self, ref_dir: str) -> torch.nn.Module:
        ref = build_gpt(self.shape, self.tconfig, self.layout)
        if torch_dist_dir(ref_dir) is not None:
            load_torch_dist(ref, ref_dir, "--ref-load")
        else:
            load_hf_weights(ref, ref_dir, self.shape, self.layout)
        return ref.eval().requires_grad_(False)

    # ------------------------------------------------------------------ training

    def train(self, steps: list[list[Sample]]) -> dict[str, float]:
        steps = self._replica_share(steps)
        micro = [[make_micro_batch(mb, self.pad_id, self._seq_multiple()) for mb in self._split(step)]
                 for step in steps]
        flat = [mb for step in micro for mb in step]
        old = self._frozen_logprobs(self.optim.model, flat)
        ref = self._frozen_logprobs(self.ref, flat) if self.ref is not None else [None] * len(flat)
        sums = MetricMeans()
        if self.layout.is_last_stage:
            sums.add("train/train_rollout_logprob_abs_diff", _rollout_diff(old, flat, self.ctx.device))
        if self.config.use_rollout_logprobs:  # the engines' logprobs are the ratio's denominator
            old = [None if o is None else b.packed.rollout_logprobs.to(self.ctx.device) for o, b in zip(old, flat)]
        cursor = 0
        for index, step in enumerate(micro):
            inputs = StepInputs(step, old[cursor:cursor + len(step)], ref[cursor:cursor + len(step)])
            cursor += len(step)
            step_metrics = self._optimizer_step(inputs)
            if index == 0 and "train/ppo_kl" in step_metrics:  # on-policy by construction: ratio 1
                sums.add("train/ppo_kl_first_minibatch", step_metrics["train/ppo_kl"])
            for key, value in step_metrics.items():
                sums.add(key, value)
        return self._from_last_stage(sums.means())

    def _replica_share(self, steps: list[list[Sample]]) -> list[list[Sample]]:
        """Pool the shares of this rank's DP replica (collective over all ranks).

        ``TrainerGroup`` deals a global batch round-robin (rank r gets samples r, r + world,
        ...), so interleaving the peers' shares in rank order restores the samples' order:
        with one replica, micro-batches are exactly those of a single-rank run."""
        if self.layout.dp_size == self.world_size:
            return steps
        shares: list = [None] * self.world_size
        dist.all_gather_object(shares, (self.layout.dp_rank, steps))
        peers = [share for dp_rank, share in shares if dp_rank == self.layout.dp_rank]
        return [_interleave([share[i] for share in peers]) for i in range(len(steps))]

    def _split(self, samples: list[Sample]) -> list[list[Sample]]:
        if self.config.use_dynamic_batch_size:
            return token_budget_batches(samples, self.config.max_tokens_per_gpu * self.layout.cp_size)
        return fixed_size_batches(samples, self.config.micro_batch_size)

    def _seq_multiple(self) -> int:
        tp = self.layout.tp_size if self.tconfig.sequence_parallel else 1
        return tp * (2 * self.layout.cp_size if self.layout.cp_size > 1 else 1)

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, batches: list[MicroBatch]) -> list[torch.Tensor | None]:
        """Response logprobs of ``batches`` under ``model`` (last stage; None on the others)."""
        outputs = run_micro_batches(model, batches, self.ctx, logprob_loss_fn(batches, self.ctx), forward_only=True)
        if not self.layout.is_last_stage:
            return [None] * len(batches)
        return [out["logprobs"] for out in outputs]

    def _optimizer_step(self, inputs: StepInputs) -> dict[str, float]:
        self.optim.zero_grad()
        outputs = run_micro_batches(self.optim.model, inputs.micro_batches, self.ctx,
                                    policy_loss_fn(inputs, self.config, self.ctx), forward_only=False,
                                    no_sync=self.optim.no_sync)
        grad_norm = self.optim.step()
        sums = MetricMeans()
        for metrics in outputs:
            for key, value in metrics.items():
                sums.add(key, value)
        result = sums.means()
        result["train/grad_norm"] = grad_norm
        result["train/lr"] = self.optim.lr
        return result

    def _from_last_stage(self, metrics: dict[str, float]) -> dict[str, float]:
        """Every rank reports its replica's metrics (the loss is computed on the last stage)."""
        if self.layout.pp_size == 1:
            return metrics
        from megatron.core import parallel_state as ps

        box = [metrics]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------ export / state

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_hf(self.gpt, self.shape, self.layout, self.plan)

    def state_dict(self) -> dict:
        """This rank's shard (reload with the same parallel layout)."""
        return {"model": self.gpt.state_dict(), "optimizer": self.optim.state_dict(),
                "torch_rng": torch.get_rng_state(), "layout": self.layout}

    def load_state_dict(self, state: dict) -> None:
        if state["layout"] != self.layout:
            raise ConfigError(f"the checkpoint was saved with parallel layout {state['layout']}, this run has "
                              f"{self.layout}", ("--load", "--tensor-model-parallel-size",
                                                 "--pipeline-model-parallel-size", "--context-parallel-size"))
        self.gpt.load_state_dict(state["model"])
        self.optim.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])


def _interleave(lists: list[list[Sample]]) -> list[Sample]:
    longest = max(len(items) for items in lists)
    return [items[k] for k in range(longest) for items in lists if k < len(items)]


def _rollout_diff(old: list[torch.Tensor], batches: list[MicroBatch], device: torch.device) -> float:
    diffs = [masked_mean((o - b.packed.rollout_logprobs.to(device)).abs(), b.packed.response_mask.to(device))
             for o, b in zip(old, batches)]
    return torch.stack(diffs).mean().item()
