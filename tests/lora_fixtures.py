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


def publish_adapter_chain(model_dir: Path, store: str, base_dir: Path, versions: int,
                          base_in_store: bool = False) -> dict[str, str]:
    """A LoRA run's publication without the run: the trainer's adapter as the chain's version 0 at
    ``base_dir`` (``base_in_store``: and, with the model's base, in the object store ``store``, as a
    LoRA run with --rollout-base-from-store puts them) and ``versions`` trained adapter versions in ``store`` (a directory or ``s3://``); returns the
    checksums of the last version (what an engine serving it must hold)."""
    from miles_disagg.trainer.lora import adapter_config
    from miles_disagg.weights.adapters import write_adapter_dir
    from miles_disagg.weights.publisher import DeltaPublisher

    trainer = lora_trainer(model_dir, lr=5e-2)
    write_adapter_dir(base_dir, adapter_config(trainer.lora), trainer.adapter_tensors())
    publisher = DeltaPublisher(store, base_dir=base_dir, run_id="lora-chain", encoding="xor", filter="none",
                               base_in_store=base_in_store, model_in_store=model_dir if base_in_store else None)
    try:
        publisher.capture_baseline()
        for step in range(1, versions + 1):
            trainer.train([lora_samples(step)])
            publisher.publish(trainer.adapter_tensors().items())
        return publisher.published_checksums("xxh3-128")
    finally:
        publisher.close()
