"""``miles-disagg make-tiny-checkpoint --out DIR``: write a random tiny Qwen3 HF checkpoint
(``--num-experts N``: a Qwen3-MoE).

Nothing is downloaded (see :mod:`miles_disagg.models.tiny_qwen3`). The checkpoint is
written into a staging directory beside ``--out`` and renamed into place, so ``--out``
is either absent, untouched, or complete. An existing non-empty ``--out`` is refused
unless ``--force``, which replaces it. Prints one JSON object (path and shape) on stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.models.tiny_qwen3 import CHARSETS, SPECIAL_TOKENS
from miles_disagg.types import InvalidInput

SIZE_FLAGS = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab",
              "max_position_embeddings")


class OutputDirNotEmpty(InvalidInput):
    """``--out`` already holds files and ``--force`` was not given; nothing was written."""


@dataclass(kw_only=True)
class TinyCheckpointCommand:
    """Write a random tiny Qwen3 HF checkpoint (no download)."""

    out: Path = flag(REQUIRED, "Checkpoint directory to create.")
    hidden_size: int = flag(64, "Model width.")
    intermediate_size: int | None = flag(None, "MLP width (default: 2 x hidden size).")
    num_layers: int = flag(2, "Decoder layers.")
    num_heads: int = flag(4, "Attention heads.")
    num_kv_heads: int = flag(2, "Key/value heads.")
    head_dim: int | None = flag(None, "Per-head width (default: hidden size / heads).")
    vocab: int | None = flag(None, "Vocabulary size, at least the tokenizer's (default: tokenizer size rounded up to 8).")
    max_position_embeddings: int = flag(2048, "Context length.")
    dtype: str = flag("float32", "Weight dtype.", choices=("float32", "bfloat16"))
    seed: int = flag(0, "Weight initialization seed.")
    charset: str = flag("full", "Tokenizer characters: full (printable ASCII) or digits (arithmetic tasks).",
                        choices=tuple(CHARSETS))
    num_experts: int = flag(0, "Experts per layer: > 0 makes a Qwen3-MoE (every layer sparse); 0 a dense Qwen3.")
    num_experts_per_tok: int = flag(2, "Experts each token is routed to (MoE only).")
    moe_intermediate_size: int | None = flag(None, "Width of each expert (MoE only; default: MLP width / 2).")
    force: bool = flag(False, "Replace a non-empty --out.")

    def __post_init__(self) -> None:
        """Impossible shapes fail here, naming the flag(s)."""
        for name in SIZE_FLAGS:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"--num-heads {self.num_heads} must be a multiple of --num-kv-heads {self.num_kv_heads}")
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError(f"--hidden-size {self.hidden_size} is not divisible by --num-heads {self.num_heads}; "
                             "give --head-dim")
        self._check_experts()
        tokenizer_size = len(dict.fromkeys((*SPECIAL_TOKENS, *CHARSETS[self.charset])))
        if self.vocab is not None and self.vocab < tokenizer_size:
            raise ValueError(f"--vocab must be at least the tokenizer's {tokenizer_size} tokens, got {self.vocab}")

    def _check_experts(self) -> None:
        if self.num_experts < 0:
            raise ValueError(f"--num-experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"--num-experts-per-tok must be in [1, --num-experts {self.num_experts}], "
                             f"got {self.num_experts_per_tok}")
        if self.moe_intermediate_size is not None and self.moe_intermediate_size < 1:
            raise ValueError(f"--moe-intermediate-size must be >= 1, got {self.moe_intermediate_size}")

    def moe_shape(self) -> dict[str, int]:
        """The MoE keyword arguments of ``make_tiny_qwen3`` (none for a dense model)."""
        if not self.num_experts:
            return {}
        width = self.moe_intermediate_size or (self.intermediate_size or 2 * self.hidden_size) // 2
        return {"num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
                "moe_intermediate_size": width}

    def model_shape(self) -> dict[str, int | None]:
        """The ``make_tiny_qwen3`` keyword arguments."""
        return {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size or 2 * self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim or self.hidden_size // self.num_heads,
            "vocab_size": self.vocab,
            "max_position_embeddings": self.max_position_embeddings,
        }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, TinyCheckpointCommand)


def run(args: argparse.Namespace) -> int:
    from miles_disagg.models.tiny_qwen3 import make_tiny_qwen3

    command = config_from_args(TinyCheckpointCommand, args)
    shape = {**command.model_shape(), **command.moe_shape()}
    out = command.out
    check_destination(out, force=command.force)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
        make_tiny_qwen3(staging, dtype=command.dtype, seed=command.seed, charset=CHARSETS[command.charset], **shape)
        shape["vocab_size"] = json.loads((staging / "config.json").read_text())["vocab_size"]
        if out.exists():  # an empty directory, or a non-empty one with --force
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(json.dumps({"out": str(out.resolve()), "dtype": command.dtype, "seed": command.seed,
                      "charset": command.charset, **shape}))
    return 0


def check_destination(out: Path, *, force: bool) -> None:
    """Refuse an existing file, or a non-empty directory without ``force``."""
    if out.exists() and not out.is_dir():
        raise OutputDirNotEmpty(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputDirNotEmpty(f"--out {str(out)!r} is not empty; pass --force to replace it")
