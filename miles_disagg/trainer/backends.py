"""Which :class:`~miles_disagg.trainer.backend.TrainerBackend` a trainer rank runs (``--train-backend``).

The factory sits apart from the port (``trainer/backend.py``) so the implementations import the port
and nothing imports them but this module: megatron-core is imported only when it is chosen.
"""

from __future__ import annotations

from miles_disagg.config.training import TrainConfig
from miles_disagg.trainer.backend import TrainerBackend
from miles_disagg.types import ConfigError


def make_backend(config: TrainConfig, hf_dir: str, *, rank: int, world_size: int,
                 temperature: float = 1.0, initial_checkpoint: tuple[str, str] | None = None) -> TrainerBackend:
    """The ``--train-backend`` for this rank (megatron-core is imported only when chosen);
    ``initial_checkpoint``: ``(path, flag)`` of a Megatron torch_dist checkpoint to start from."""
    if config.train_backend == "fsdp":
        from miles_disagg.trainer.fsdp import FSDPBackend

        if initial_checkpoint is not None:
            raise ConfigError(f"{initial_checkpoint[1]} {initial_checkpoint[0]} is a Megatron torch_dist checkpoint: "
                              "use --train-backend megatron", (initial_checkpoint[1], "--train-backend"))
        return FSDPBackend(config, hf_dir, rank=rank, world_size=world_size, temperature=temperature)
    if config.train_backend == "megatron":
        from miles_disagg.trainer.megatron.backend import MegatronBackend

        return MegatronBackend(config, hf_dir, rank=rank, world_size=world_size, temperature=temperature,
                               initial_checkpoint=initial_checkpoint)
    raise ConfigError(f"unknown --train-backend {config.train_backend!r}; expected fsdp or megatron", ("--train-backend",))
