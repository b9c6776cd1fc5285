"""``--train-backend fsdp``: any HF causal LM, PyTorch FSDP2 on GPU.

The model is :func:`miles_disagg.models.causal_lm.load_causal_lm`'s (the native Qwen3 on CPU
where it applies, transformers otherwise).

On GPU each decoder layer and the root are sharded with ``fully_shard`` (FSDP2), parameters
kept in float32 and computed in bfloat16. On CPU (no CUDA) the same backend runs plain
data parallelism over gloo (``DistributedDataParallel``; a single rank runs unwrapped):
sharding buys nothing there and FSDP2 needs an accelerator.

Qwen3-MoE: routing replay (``--use-rollout-routing-replay``, ``--use-routing-replay``) and the
routing metrics are :mod:`miles_disagg.trainer.fsdp_routing`'s: the native model takes the routing
as an argument, transformers' (on CUDA) through hooks on its routers.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterator

import torch

from miles_disagg.config.training import TrainConfig
from miles_disagg.trainer.backend import TrainerBackend
from miles_disagg.trainer.results import TrainResult
from miles_disagg.trainer.batches import PackedBatch, pack, response_logits
from miles_disagg.trainer.data_parallel import clip_and_step, unsynced_if, wrap_for_data_parallel
from miles_disagg.trainer.fsdp_routing import (
    RouterReplay, RoutingCounts, RoutingShape, pack_engine_routing, require_engine_routing,
)
from miles_disagg.trainer.shares import micro_batches
from miles_disagg.trainer.losses import token_logprobs_and_entropy
from miles_disagg.trainer.objective import TrainObjective
from miles_disagg.trainer.reduction import StepMetrics
from miles_disagg.trainer.rollout_inputs import FrozenInputs, prepare_rollout
from miles_disagg.samples import Sample

log = logging.getLogger(__name__)


class FSDPBackend(TrainerBackend):
    def __init__(self, config: TrainConfig, hf_dir: str, *, rank: int, world_size: int, temperature: float = 1.0):
        """``temperature``: the rollout's sampling temperature; logprobs are computed on
        ``logits / temperature`` so they are those of the distribution the engines sampled."""
        from miles_disagg.models.causal_lm import load_causal_lm

        self.config, self.rank, self.world_size = config, rank, world_size
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        torch.manual_seed(config.seed + rank)
        model = load_causal_lm(hf_dir, dtype="auto", runs_on=self.device,  # loaded on the CPU, moved below
                               dequantize=config.train_from_dequantized_checkpoint)
        self.export_dtypes = {name: t.dtype for name, t in model.state_dict().items()}
        self.pad_id = model.config.pad_token_id or 0
        self.module = model.float().to(self.device)  # float32 master weights
        self.lora = self._attach_lora(hf_dir) if config.lora_rank else None
        self.routing_shape = RoutingShape.of(self.module)
        self._check_replay_flags(hf_dir)
        self.router_replay = self._router_replay(self.module)
        self.model = wrap_for_data_parallel(self.module, self.device, world_size,
                                            has_experts=self.routing_shape is not None)
        self.ref_model = self._load_reference(hf_dir) if config.needs_reference else None
        self.ref_replay = self._router_replay(self.ref_model) if self.ref_model is not None else None
        self.objective = TrainObjective(config, self.temperature)  # --loss-type; its hooks checked here
        self.optimizer = torch.optim.AdamW(  # LoRA: the adapter's parameters only (the base is frozen)
            [p for p in self.model.parameters() if p.requires_grad], lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps, weight_decay=config.weight_decay)

    # ------------------------------------------------------------------ setup

    def _attach_lora(self, hf_dir: str):
        from miles_disagg.trainer.lora import LoraSettings, attach_adapter, load_adapter

        settings = LoraSettings.of(self.config)
        attach_adapter(self.module, settings, self.config.seed)
        if self.config.lora_adapter_path:
            load_adapter(self.module, self.config.lora_adapter_path, settings)
        log.info("LoRA rank %d alpha %d on %s of %s%s", settings.rank, settings.alpha, ",".join(settings.targets),
                 hf_dir, " (--lora-train-only: the engines roll out on the frozen base)"
                 if self.config.lora_train_only else "")
        return settings

    def _router_replay(self, module: torch.nn.Module) -> RouterReplay | None:
        """Hooks on a transformers Qwen3-MoE's routers (the native model routes through an argument)."""
        from miles_disagg.models.qwen3_moe import Qwen3MoeForCausalLM

        if self.routing_shape is None or isinstance(module, Qwen3MoeForCausalLM):
            return None
        return RouterReplay(module, self.routing_shape)

    def _check_replay_flags(self, hf_dir: str) -> None:
        from miles_disagg.types import ConfigError

        for name, on in (("--use-rollout-routing-replay", self.config.use_rollout_routing_replay),
                         ("--use-routing-replay", self.config.use_routing_replay)):
            if on and self.routing_shape is None:
                raise ConfigError(f"{name} needs a mixture-of-experts model (Qwen3-MoE); {hf_dir!r} is not one",
                                  (name,))

    def _load_reference(self, hf_dir: str) -> torch.nn.Module:
        from miles_disagg.models.causal_lm import load_causal_lm

        ref = load_causal_lm(self.config.ref_load or hf_dir, dtype=torch.float32, device=self.device,
                             dequantize=self.config.train_from_dequantized_checkpoint and not self.config.ref_load)
        return ref.eval().requires_grad_(False)

    # ------------------------------------------------------------------ training

    def _forward(self, model: torch.nn.Module, batch: PackedBatch, routing: torch.Tensor | None):
        inputs = {"input_ids": batch.input_ids.to(self.device), "attention_mask": batch.attention_mask.to(self.device)}
        replay = self.ref_replay if model is self.ref_model else self.router_replay
        if replay is not None:
            return replay.forward(model, routing, **inputs)
        return model(**inputs, **({} if routing is None else {"routing": routing.to(self.device)}))

    def _token_logprobs(self, model: torch.nn.Module, batch: PackedBatch, with_entropy: bool,
                        routing: torch.Tensor | None = None):
        out = self._forward(model, batch, routing)
        logprobs, entropy = token_logprobs_and_entropy(response_logits(out.logits, batch) / self.temperature,
                                                       batch.response_ids.to(self.device), with_entropy)
        return logprobs, entropy, out

    @torch.no_grad()
    def _frozen_logprobs(self, model: torch.nn.Module, batches: list[PackedBatch], routes: list) -> list[torch.Tensor]:
        return [self._token_logprobs(model, b, False, r)[0] for b, r in zip(batches, routes)]

    def _engine_routes(self, steps: list[list[list[Sample]]]) -> list[torch.Tensor | None]:
        """Per micro-batch: the engine's routing packed as the batch is (None: a dense model or none given)."""
        if self.routing_shape is None:
            return [None for step in steps for _ in step]
        if self.config.use_rollout_routing_replay:
            require_engine_routing([s for step in steps for mb in step for s in mb])
        return [pack_engine_routing(mb, max(len(s.prompt_ids) + len(s.response_ids) for s in mb), self.routing_shape)
                for step in steps for mb in step]

    @torch.no_grad()
    def _recorded_routes(self, batches: list[PackedBatch]) -> list[torch.Tensor]:
        """``--use-routing-replay``: the routing of this forward pass, which the training passes replay."""
        return [self._forward(self.model, b, None).routed_experts.long().cpu() for b in batches]

    def train(self, steps: list[list[Sample]]) -> TrainResult:
        mbs = self.config.micro_batch_size
        split = [list(micro_batches(step, mbs)) for step in steps]
        packed = [[pack(mb, self.pad_id) for mb in step] for step in split]
        flat = [b for step in packed for b in step]
        engine = self._engine_routes(split)
        replay = engine if self.config.use_rollout_routing_replay else [None] * len(flat)
        ref_replay = replay  # the reference replays the engines' routing too; its own forward routes freely
        if self.config.use_routing_replay and not self.config.use_rollout_routing_replay:
            replay = self._recorded_routes(flat)
        recomputed = (self._frozen_logprobs(self.model, flat, replay) if not self.config.skip_actor_forward_only
                      else [None] * len(flat))
        ref = (self._frozen_logprobs(self.ref_model, flat, ref_replay) if self.ref_model is not None
               else [None] * len(flat))
        inputs = prepare_rollout(self.config, packed, recomputed, ref, device=self.device)
        result = TrainResult(rollout=inputs.metrics)
        cursor = 0
        for step, denominator in zip(packed, inputs.denominators):
            window = slice(cursor, cursor + len(step))
            cursor += len(step)
            result.steps.append(self._optimizer_step(step, inputs.micro[window], denominator, replay[window],
                                                     engine[window]))
        return result

    def _optimizer_step(self, batches: list[PackedBatch], frozen: list[FrozenInputs], denominator: float,
                        replay: list, engine: list) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; ``denominator`` is the step's global
        sample (or token) count. Ranks average gradients, so each backpropagates
        ``world_size / denominator`` times its sum: the mean over the global batch."""
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.world_size / denominator
        sums, routing = StepMetrics(), RoutingCounts()
        for i, batch in enumerate(batches):
            with unsynced_if(self.model, i < len(batches) - 1):
                logprobs, entropy, out = self._token_logprobs(self.model, batch, True, replay[i])
                if self.routing_shape is not None:
                    routing.add(batch, self.routing_shape, engine[i], out.routed_experts, out.router_choice,
                                replaying_engine=self.config.use_rollout_routing_replay)
                loss, metrics = self.objective(batch, frozen[i], logprobs, entropy, out.logits, self.device)
                (loss * scale).backward()
            sums.add(metrics)
        grad_norm = clip_and_step(self.model, self.optimizer, self.config.clip_grad)
        result = sums.global_means(denominator, device=self.device)
        if self.routing_shape is not None:
            result.update(routing.global_metrics(self.device))
        result["train/grad_norm"] = grad_norm
        result["train/lr"] = self.optimizer.param_groups[0]["lr"]
        return result

    # ------------------------------------------------------------------ export / state

    def named_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights to publish, in the checkpoint's on-disk names (transformers' fused in-memory
        experts of a Qwen3-MoE split per expert)."""
        from miles_disagg.models.moe_names import on_disk_tensors

        return on_disk_tensors(self._state_tensors())

    def publish_share(self, sizes: dict[str, int]) -> frozenset[str]:
        self._share = super().publish_share(sizes)
        return self._share

    def share_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor is still gathered (collective), but only this rank's share (and fused
        expert tensors, whose experts may fall in several shares) is copied to the CPU."""
        from miles_disagg.models.moe_names import FUSED_DOWN, FUSED_GATE_UP, on_disk_tensors

        share = getattr(self, "_share", None)
        if share is None:
            return self.named_tensors()
        return on_disk_tensors(self._state_tensors(
            lambda name: name in share or bool(FUSED_GATE_UP.match(name) or FUSED_DOWN.match(name))))

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """LoRA runs: the adapter under PEFT's saved names (collective)."""
        from miles_disagg.trainer.lora import adapter_state

        return adapter_state(self.module)

    def _named_state(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self.lora is None:
            return iter(self.module.state_dict().items())
        from miles_disagg.trainer.lora import policy_tensors

        return policy_tensors(self.module, merge=not self.config.lora_train_only)

    @torch.no_grad()
    def _state_tensors(self, keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self._named_state():
            if name not in self.export_dtypes:
                continue
            if hasattr(tensor, "full_tensor"):  # FSDP2 DTensor: gather (collective)
                tensor = tensor.full_tensor()
            if keep is None or keep(name):
                yield name, tensor.detach().to("cpu", self.export_dtypes[name])

    def offload_targets(self) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        return self.module, self.optimizer

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """Model and optimizer into ``directory/state`` through ``torch.distributed.checkpoint``,
        this rank's RNG into ``directory/rng`` (collective).

        The distributed state-dict helpers name every tensor by its parameter's FQN with its full
        shape (FSDP2 shards as DTensors, each written by its owner; DDP replicas written once),
        and the optimizer state is flattened to one entry per parameter and moment, so the saved
        layout is the same for any number of ranks and any of the three wrappings (FSDP2,
        DDP, a single unwrapped rank)."""
        import torch.distributed.checkpoint as dcp

        from miles_disagg.trainer.rank_state import save_rng, state_dir

        dcp.save(self._checkpoint_state(), checkpoint_id=state_dir(directory))  # LoRA: the adapter and its moments
        save_rng(directory, self.rank)

    def load_checkpoint(self, directory: str) -> None:
        """Restore what ``save_checkpoint`` wrote, whatever number of ranks wrote it (collective):
        each rank reads the parts of every tensor it holds. RNG: see ``trainer/rank_state.py``."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from miles_disagg.trainer.rank_state import load_rng, state_dir

        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=state_dir(directory))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_dcp_options(self.lora is not None))
        load_rng(directory, self.rank, self.config.seed)

    def _checkpoint_state(self) -> dict:
        """Live model and optimizer state as DCP entries (a fresh optimizer's state is created
        with zero moments first, so loading has tensors to fill)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer, options=_dcp_options(self.lora is not None))
        return {"model": model, "optimizer": optimizer}


def _dcp_options(adapter_only: bool = False):
    """``adapter_only`` (LoRA): the frozen base is neither saved nor loaded (it comes from
    --hf-checkpoint); every adapter tensor must be in the save (``dcp.load`` reads each one asked for)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=adapter_only,
                            strict=not adapter_only)
