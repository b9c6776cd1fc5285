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

from miles_disagg.config.training import TrainConfig
from miles_disagg.trainer.backend import TrainerBackend
from miles_disagg.trainer.results import TrainResult
from miles_disagg.trainer.megatron.batching import (
    MicroBatch, fixed_size_batches, make_micro_batch, token_budget_batches)
from miles_disagg.trainer.megatron.checkpoint import load_checkpoint, save_checkpoint
from miles_disagg.trainer.megatron.export import ExportPlan, export_hf
from miles_disagg.trainer.megatron.convert import stage_layers
from miles_disagg.trainer.megatron.model import (
    build_gpt, check_moe_support, import_megatron, init_parallel_state, load_hf_weights, read_hf_config,
    transformer_config, uses_te_spec)
from miles_disagg.trainer.megatron.moe import RoutingControl
from miles_disagg.trainer.megatron.optim import make_optimizer
from miles_disagg.trainer.torch_dist import load_torch_dist, torch_dist_dir
from miles_disagg.trainer.megatron.step import (
    PassContext, StepInputs, logprob_loss_fn, policy_loss_fn, run_micro_batches)
from miles_disagg.trainer.objective import TrainObjective
from miles_disagg.trainer.reduction import StepMetrics
from miles_disagg.trainer.rollout_inputs import prepare_rollout
from miles_disagg.samples import Sample


class MegatronBackend(TrainerBackend):
    def __init__(self, config: TrainConfig, hf_dir: str, *, rank: int, world_size: int, temperature: float = 1.0,
                 initial_checkpoint: tuple[str, str] | None = None):
        """Build the parallel state, this rank's model stage from ``hf_dir`` (then, given
        ``initial_checkpoint`` ``(path, flag)``, the weights of that Megatron torch_dist
        checkpoint), its optimizer and (``--use-kl-loss`` whatever its coefficient, or ``--kl-coef``)
        the frozen reference from ``--ref-load`` (HF or torch_dist) or ``hf_dir``. ``temperature``:
        the rollout's, applied to logits before logprobs."""
        import_megatron()
        self.config, self.rank, self.world_size = config, rank, world_size
        self.layout = init_parallel_state(config, world_size)
        hf_config, self.shape = read_hf_config(hf_dir)
        self.shape.check_parallel(self.layout.tp_size, self.layout.pp_size, self.layout.ep_size)
        check_moe_support(self.shape, config, self.layout)
        self.pad_id = hf_config.pad_token_id or 0
        self.grouped = bool(config.moe_grouped_gemm)
        self.plan = ExportPlan.build(hf_dir, self.shape, self.layout.pp_size, uses_te_spec(), self.layout.ep_size,
                                     self.grouped)  # fail before building
        torch.manual_seed(config.seed + rank)
        self.tconfig = transformer_config(self.shape, config, self.layout)
        self.gpt = build_gpt(self.shape, self.tconfig, self.layout)
        load_hf_weights(self.gpt, hf_dir, self.shape, self.layout, self.grouped)
        self.routing = {id(self.gpt): self._routing_control(self.gpt)} if self.shape.is_moe else {}
        if initial_checkpoint is not None:
            load_torch_dist(self.gpt, *initial_checkpoint)
        self.optim = make_optimizer(self.gpt, config, self.tconfig)
        if self.routing:  # forward passes call the optimizer's wrapper (DDP on GPU) of the same modules
            self.routing[id(self.optim.model)] = self.routing[id(self.gpt)]
        self.ref = self._reference(config.ref_load or hf_dir) if config.needs_reference else None
        if self.ref is not None and self.shape.is_moe:
            self.routing[id(self.ref)] = self._routing_control(self.ref)
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.ctx = PassContext(self.layout, device, temperature if temperature > 0 else 1.0,
                               explicit_mask=not uses_te_spec())
        self.objective = TrainObjective(config, self.ctx.temperature)  # --loss-type; its hooks checked here

    def _reference(self, ref_dir: str) -> torch.nn.Module:
        ref = build_gpt(self.shape, self.tconfig, self.layout)
        if torch_dist_dir(ref_dir) is not None:
            load_torch_dist(ref, ref_dir, "--ref-load")
        else:
            load_hf_weights(ref, ref_dir, self.shape, self.layout, self.grouped)
        return ref.eval().requires_grad_(False)

    def _routing_control(self, model: torch.nn.Module) -> RoutingControl:
        return RoutingControl(
            model, stage_layers(self.shape.num_layers, self.layout.pp_size, self.layout.pp_rank),
            replay_rollout=self.config.use_rollout_routing_replay, replay_recompute=self.config.use_routing_replay,
            recomputes=self.config.recompute_granularity is not None, sequence_parallel=self.tconfig.sequence_parallel,
            tp_rank=self.layout.tp_rank, tp_size=self.layout.tp_size, cp_rank=self.layout.cp_rank,
            cp_size=self.layout.cp_size)

    # ------------------------------------------------------------------ training

    def train(self, steps: list[list[Sample]]) -> TrainResult:
        steps = self._replica_share(steps)
        moe = (self.shape.num_layers, self.shape.moe_topk, self.shape.num_experts) if self.shape.is_moe else None
        micro = [[make_micro_batch(mb, self.pad_id, self._seq_multiple(), moe) for mb in self._split(step)]
                 for step in steps]
        flat = [mb for step in micro for mb in step]
        recomputed = (self._frozen_logprobs(self.optim.model, flat) if not self.config.skip_actor_forward_only
                      else [None] * len(flat))
        ref = self._frozen_logprobs(self.ref, flat) if self.ref is not None else [None] * len(flat)
        if not self.layout.is_last_stage:  # the loss, advantages and metrics live on the last stage
            for step in micro:
                self._optimizer_step(StepInputs(step, [None] * len(step), denominator=1.0))
            return self._from_last_stage(TrainResult())
        group, device = self._dp_group(), self.ctx.device
        prepared = prepare_rollout(self.config, [[mb.packed for mb in step] for step in micro], recomputed, ref,
                                   group, device)
        result = TrainResult(rollout=prepared.metrics)
        cursor = 0
        for step, denominator in zip(micro, prepared.denominators):
            window = slice(cursor, cursor + len(step))
            cursor += len(step)
            result.steps.append(self._optimizer_step(StepInputs(step, prepared.micro[window], denominator), group))
        return self._from_last_stage(result)

    def _dp_group(self):
        """The data-parallel group (replicas of this stage; TP and CP peers hold the same samples)."""
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_group()

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
        outputs = run_micro_batches(model, batches, self.ctx, logprob_loss_fn(batches, self.ctx), forward_only=True,
                                    routing=self.routing.get(id(model)))
        if not self.layout.is_last_stage:
            return [None] * len(batches)
        return [out["logprobs"] for out in outputs]

    def _optimizer_step(self, inputs: StepInputs, group=None) -> dict[str, float]:
        """One optimizer step (collective over all ranks); the step's global metrics on the last stage."""
        self.optim.zero_grad()
        outputs = run_micro_batches(self.optim.model, inputs.micro_batches, self.ctx,
                                    policy_loss_fn(inputs, self.objective, self.ctx), forward_only=False,
                                    no_sync=self.optim.no_sync, routing=self.routing.get(id(self.gpt)),
                                    count_routing=True)
        grad_norm = self.optim.step()
        routing = self._routing_metrics(group)
        if not self.layout.is_last_stage:
            return {}
        sums = StepMetrics()
        for metrics in outputs:
            sums.add(metrics)
        result = sums.global_means(inputs.denominator, group, self.ctx.device)
        result["train/grad_norm"] = grad_norm
        result["train/lr"] = self.optim.lr
        result.update(routing)
        return result

    def _routing_metrics(self, group) -> dict[str, float]:
        """``train/routing_agreement`` (and with replay ``train/routing_replay_match``) of the step
        just taken, over the trained tokens of every replica and stage (collective; {} when dense)."""
        control = self.routing.get(id(self.gpt))
        if control is None:
            return {}
        counts = control.take_counts()
        total = torch.tensor([counts.rows, counts.agreed, counts.matched], dtype=torch.float64)
        for reduce_group in (group, self._pp_group()):
            if reduce_group is not None and dist.get_world_size(reduce_group) > 1:
                dist.all_reduce(total, group=reduce_group)
        rows, agreed, matched = total.tolist()
        if rows == 0:
            return {}
        metrics = {"train/routing_agreement": agreed / rows}
        if self.config.use_rollout_routing_replay:
            metrics["train/routing_replay_match"] = matched / rows
        return metrics

    def _pp_group(self):
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_group() if self.layout.pp_size > 1 else None

    def _from_last_stage(self, result: TrainResult) -> TrainResult:
        """Every rank reports its replica's metrics (the loss is computed on the last stage)."""
        if self.layout.pp_size == 1:
            return result
        from megatron.core import parallel_state as ps

        box = [result]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------ export / state

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        return export_hf(self.gpt, self.shape, self.layout, self.plan)

    def publish_share(self, sizes: dict[str, int]) -> frozenset[str]:
        """By pipeline stage and expert-parallel rank, dense tensors split over the data-parallel
        replicas (``sharded_export``)."""
        from miles_disagg.trainer.megatron.sharded_export import share_names

        return share_names(self.plan, self.layout)

    def share_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from miles_disagg.trainer.megatron.sharded_export import export_share

        return export_share(self.gpt, self.shape, self.layout, self.plan)

    def save_checkpoint(self, directory: str) -> None:
        """megatron-core distributed checkpointing: reloads under another TP/DP layout (``checkpoint.py``)."""
        save_checkpoint(self.gpt, self.optim, directory, self.rank)

    def load_checkpoint(self, directory: str) -> None:
        load_checkpoint(self.gpt, self.optim, directory, self.rank, self.config.seed)


def _interleave(lists: list[list[Sample]]) -> list[Sample]:
    longest = max(len(items) for items in lists)
    return [items[k] for k in range(longest) for items in lists if k < len(items)]

