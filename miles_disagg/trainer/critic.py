"""One rank of a PPO critic (``--advantage-estimator ppo``) on FSDP: a value model and its optimizer.

The model is the policy's base checkpoint (:func:`miles_disagg.models.causal_lm.load_causal_lm`)
with its LM head replaced by a value head, as miles builds its critic: a ``Linear(hidden, 1)``
with a bias, weight drawn from N(0, 0.02) (the same on every rank: ``--seed``), bias 0. The value
of response token ``t`` is the head's output at the position that predicts it (where its logprob
is read), in float32. Wrapped as the policy is (``trainer/fsdp.py``): FSDP2 with bf16 compute on
GPU, DDP over gloo on CPU, unwrapped on one CPU rank.

Per rollout: :meth:`CriticBackend.values` scores the samples (forward only); the driver attaches
the values to the samples (``trainer.critic_values``); :meth:`CriticBackend.train` takes them as
the old values, computes GAE returns (``trainer.gae``) once, and runs the rollout's optimizer steps
on the clipped value loss, each normalised over the whole global batch as the policy's loss is
(so two ranks give the gradient of one). Every method is collective over the critic's ranks.
"""

from __future__ import annotations


import torch

from miles_disagg.config.actors import CriticGroupConfig
from miles_disagg.trainer.batches import PackedBatch, pack, response_logits
from miles_disagg.trainer.data_parallel import clip_and_step, unsynced_if, wrap_for_data_parallel
from miles_disagg.trainer.gae import (
    clipped_value_loss, explained_variance, explained_variance_sums, ppo_advantages_and_returns,
)
from miles_disagg.trainer.losses import masked_sum
from miles_disagg.trainer.reduction import StepMetrics, step_denominators, sum_over_ranks
from miles_disagg.trainer.results import TrainResult
from miles_disagg.trainer.shares import micro_batches
from miles_disagg.samples import Sample

VALUE_HEAD_STD = 0.02
SCHEDULE_KEY = "critic_schedule"


def attach_value_head(model: torch.nn.Module, seed: int) -> torch.nn.Linear:
    """Replace ``model``'s LM head with a fresh value head (weight ~ N(0, 0.02) from ``seed``, bias 0);
    its forward's ``logits`` are then ``[batch, seq, 1]`` values."""
    hidden = model.config.hidden_size
    head = torch.nn.Linear(hidden, 1, bias=True, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(head.weight.shape, generator=generator) * VALUE_HEAD_STD)
        head.bias.zero_()
    model.lm_head = head
    return head


class CriticBackend:
    def __init__(self, config: CriticGroupConfig, *, rank: int, world_size: int):
        from miles_disagg.models.causal_lm import load_causal_lm

        self.config, self.train_config = config, config.train
        self.rank, self.world_size = rank, world_size
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        model = load_causal_lm(config.hf_dir, dtype="auto", runs_on=self.device)
        self.pad_id = model.config.pad_token_id or 0
        attach_value_head(model, self.train_config.seed)
        torch.manual_seed(self.train_config.seed + rank)
        self.module = model.float().to(self.device)  # float32 master weights
        self.model = wrap_for_data_parallel(self.module, self.device, self.world_size,
                                            has_experts=bool(getattr(self.module.config, "num_experts", 0)))
        train = self.train_config
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.lr,
                                           betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
                                           weight_decay=train.weight_decay)
        self.num_steps = 0  # optimizer steps taken (the lr warmup's clock; saved with the state)

    # ------------------------------------------------------------------ values

    def _values(self, batch: PackedBatch) -> torch.Tensor:
        """``[batch, response]`` values of the current model (0 on padding), float32."""
        out = self.model(input_ids=batch.input_ids.to(self.device), attention_mask=batch.attention_mask.to(self.device))
        values = response_logits(out.logits, batch).squeeze(-1).float()
        return values * batch.response_mask.to(self.device)

    @torch.no_grad()
    def values(self, samples: list[Sample]) -> list[list[float]]:
        """Each sample's value of every response token, in order (every rank scores the same number
        of micro-batches: the driver deals equal shares)."""
        out: list[list[float]] = []
        for chunk in micro_batches(samples, self.train_config.micro_batch_size):
            values = self._values(pack(chunk, self.pad_id)).cpu()
            out += [values[i, :len(s.response_ids)].tolist() for i, s in enumerate(chunk)]
        return out

    # ------------------------------------------------------------------ training

    def train(self, steps: list[list[Sample]]) -> TrainResult:
        """One rollout's optimizer steps on the value loss; ``steps[i]``: this rank's share of global
        batch i, every sample carrying its old values. Every rank returns the same result."""
        train = self.train_config
        packed = [[pack(mb, self.pad_id) for mb in micro_batches(step, train.micro_batch_size)] for step in steps]
        for batch in (b for step in packed for b in step):
            if batch.values is None:
                raise ValueError("the critic trains on samples scored by its values() first (trainer.critic_values)")
        returns = [[ppo_advantages_and_returns(b, b.values, train.gamma, train.lambd, self.device)[1] for b in step]
                   for step in packed]
        result = TrainResult(rollout=self._rollout_metrics(packed, returns))
        denominators = step_denominators(packed, per_token=train.calculate_per_token_loss, device=self.device)
        for step, step_returns, denominator in zip(packed, returns, denominators):
            result.steps.append(self._optimizer_step(step, step_returns, denominator))
        return result

    def _rollout_metrics(self, packed: list[list[PackedBatch]], returns: list[list[torch.Tensor]]) -> dict[str, float]:
        """How well the values the rollout was scored with predict its returns, over its trained tokens."""
        sums = [0.0] * 5
        values_sum = 0.0
        for step, step_returns in zip(packed, returns):
            for batch, target in zip(step, step_returns):
                mask = batch.loss_mask.to(self.device)
                old = batch.values.to(self.device)
                sums = [a + b for a, b in zip(sums, explained_variance_sums(old, target, mask))]
                values_sum += float((old.double() * mask).sum())
        totals = sum_over_ranks([*sums, values_sum], device=self.device)
        count = max(totals[0], 1.0)
        return {"critic/explained_variance": explained_variance(totals[:5]), "critic/values_mean": totals[5] / count,
                "critic/returns_mean": totals[1] / count}

    def _optimizer_step(self, batches: list[PackedBatch], returns: list[torch.Tensor],
                        denominator: float) -> dict[str, float]:
        """One optimizer step over this rank's micro-batches; ranks average gradients, so each
        backpropagates ``world_size / denominator`` times its sum: the mean over the global batch."""
        self._set_lr()
        self.optimizer.zero_grad(set_to_none=True)
        scale = self.world_size / denominator
        per_token = self.train_config.calculate_per_token_loss
        sums = StepMetrics()
        for i, (batch, target) in enumerate(zip(batches, returns)):
            with unsynced_if(self.model, i < len(batches) - 1):
                values = self._values(batch)
                mask = batch.loss_mask.to(self.device)
                loss, clipped = clipped_value_loss(values, batch.values.to(self.device), target, self.config.value_clip)
                loss_sum = masked_sum(loss, mask, per_token=per_token)
                (loss_sum * scale).backward()
            sums.add({"critic/value_loss": float(loss_sum.detach()),
                      "critic/value_clipfrac": float(masked_sum(clipped, mask, per_token=per_token))})
        grad_norm = self._clip_and_step()
        metrics = sums.global_means(denominator, device=self.device)
        metrics["critic/grad_norm"] = grad_norm
        metrics["critic/lr"] = self.optimizer.param_groups[0]["lr"]
        return metrics

    def _set_lr(self) -> None:
        """``--critic-lr-warmup-iters N``: Megatron's linear warmup, step k (from 0) at lr * k / N."""
        warmup = self.config.lr_warmup_iters
        lr = self.config.lr * min(1.0, self.num_steps / warmup) if warmup > 0 else self.config.lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _clip_and_step(self) -> float:
        norm = clip_and_step(self.model, self.optimizer, self.train_config.clip_grad)
        self.num_steps += 1
        return norm

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, directory: str) -> None:
        """Model, optimizer and the lr schedule's step count into ``directory/state`` (DCP: the same
        layout for any number of ranks), this rank's RNG into ``directory/rng`` (collective)."""
        import torch.distributed.checkpoint as dcp

        from miles_disagg.trainer.rank_state import save_rng, state_dir

        dcp.save(self._checkpoint_state(), checkpoint_id=state_dir(directory))
        save_rng(directory, self.rank)

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, whatever number of ranks wrote it (collective)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        from miles_disagg.trainer.rank_state import load_rng, state_dir

        state = self._checkpoint_state()
        dcp.load(state, checkpoint_id=state_dir(directory))
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_state_options())
        self.num_steps = int(state[SCHEDULE_KEY]["num_steps"])
        load_rng(directory, self.rank, self.train_config.seed)

    def _checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer, options=_state_options())
        return {"model": model, "optimizer": optimizer, SCHEDULE_KEY: {"num_steps": torch.tensor(self.num_steps)}}

    def value_head_state(self) -> dict[str, torch.Tensor]:
        """The value head's tensors on the CPU (collective under FSDP: gathered)."""
        out = {}
        for name, tensor in self.module.lm_head.state_dict().items():
            out[name] = (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().cpu()
        return out


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)
