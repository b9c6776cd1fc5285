"""A LoRA trainer on the tiny model and the small batches the LoRA tests train it on."""

from __future__ import annotations

from pathlib import Path

from miles_disagg.config.components import TrainConfig
from miles_disagg.samples import Sample


def lora_samples(step: int) -> list[Sample]:
    """Four samples whose responses vary with ``step`` (so successive steps move the adapter)."""
    return [Sample(prompt_ids=[5, 6, 7], response_ids=[8 + (i + step) % 3, 9, 10 + i % 2], response_logprobs=[-3.0] * 3,
                   advantage=float(i % 2) - 0.5) for i in range(4)]


def lora_trainer(model_dir: Path, lr: float):
    """A single-rank fsdp trainer of a rank-4, alpha-8 adapter on ``model_dir``."""
    from miles_disagg.trainer.fsdp import FSDPBackend

    return FSDPBackend(TrainConfig(lr=lr, global_batch_size=4, micro_batch_size=2, train_backend="fsdp",
                                   lora_rank=4, lora_alpha=8), str(model_dir), rank=0, world_size=1)
