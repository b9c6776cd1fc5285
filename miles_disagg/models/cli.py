"""``miles-disagg make-tiny-checkpoint --out DIR``: write a random tiny Qwen3 HF checkpoint.

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
from pathlib import Path

from miles_disagg.types import ConfigError, InvalidInput


class OutputDirNotEmpty(InvalidInput):
    """``--out`` already holds files and ``--force`` was not given; nothing was written."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--hidden-size", type=int, default=64, help="model width (default: 64)")
    parser.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: 2 x hidden size)")
    parser.add_argument("--num-layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument("--num-heads", type=int, default=4, help="attention heads (default: 4)")
    parser.add_argument("--num-kv-heads", type=int, default=2, help="key/value heads (default: 2)")
    parser.add_argument("--head-dim", type=int, default=None, help="per-head width (default: hidden size / heads)")
    parser.add_argument("--vocab", type=int, default=None,
                        help="vocabulary size, at least the tokenizer's (default: tokenizer size rounded up to 8)")
    parser.add_argument("--max-position-embeddings", type=int, default=2048, help="context length (default: 2048)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    parser.add_argument("--seed", type=int, default=0, help="weight initialization seed (default: 0)")
    parser.add_argument("--charset", choices=("full", "digits"), default="full",
                        help="tokenizer characters: full (printable ASCII) or digits (arithmetic tasks)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")


def run(args: argparse.Namespace) -> int:
    from miles_disagg.models.tiny_qwen3 import CHARSETS, make_tiny_qwen3

    shape = model_shape(args)
    out: Path = args.out
    check_destination(out, force=args.force)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
        make_tiny_qwen3(staging, dtype=args.dtype, seed=args.seed, charset=CHARSETS[args.charset], **shape)
        shape["vocab_size"] = json.loads((staging / "config.json").read_text())["vocab_size"]
        if out.exists():  # an empty directory, or a non-empty one with --force
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    print(json.dumps({"out": str(out.resolve()), "dtype": args.dtype, "seed": args.seed, "charset": args.charset,
                      **shape}))
    return 0


def check_destination(out: Path, *, force: bool) -> None:
    """Refuse an existing file, or a non-empty directory without ``force``."""
    if out.exists() and not out.is_dir():
        raise OutputDirNotEmpty(f"--out {str(out)!r} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutputDirNotEmpty(f"--out {str(out)!r} is not empty; pass --force to replace it")


def model_shape(args: argparse.Namespace) -> dict[str, int | None]:
    """The ``make_tiny_qwen3`` keyword arguments; ``ConfigError`` naming the flag for impossible shapes."""
    from miles_disagg.models.tiny_qwen3 import CHARSETS, SPECIAL_TOKENS

    for flag in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "vocab", "max_position_embeddings"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise _flag_error(flag, f"must be >= 1, got {value}")
    if args.num_heads % args.num_kv_heads:
        raise ConfigError(f"--num-heads {args.num_heads} must be a multiple of --num-kv-heads {args.num_kv_heads}",
                          flags=("--num-heads", "--num-kv-heads"))
    if args.head_dim is None and args.hidden_size % args.num_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-heads {args.num_heads}; "
                          "give --head-dim", flags=("--hidden-size", "--num-heads", "--head-dim"))
    tokenizer_size = len(dict.fromkeys((*SPECIAL_TOKENS, *CHARSETS[args.charset])))
    if args.vocab is not None and args.vocab < tokenizer_size:
        raise _flag_error("vocab", f"must be at least the tokenizer's {tokenizer_size} tokens, got {args.vocab}")
    return {
        "hidden_size": args.hidden_size,
        "intermediate_size": args.intermediate_size or 2 * args.hidden_size,
        "num_hidden_layers": args.num_layers,
        "num_attention_heads": args.num_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim or args.hidden_size // args.num_heads,
        "vocab_size": args.vocab,
        "max_position_embeddings": args.max_position_embeddings,
    }


def _flag_error(dest: str, message: str) -> ConfigError:
    flag = "--" + dest.replace("_", "-")
    return ConfigError(f"{flag} {message}", flags=(flag,))
