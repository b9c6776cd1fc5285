"""What every benchmark shares: a work directory (kept when asked), progress lines on stderr,
and the one JSON object on stdout."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


def progress(name: str) -> Callable[[str], None]:
    """A function printing ``[bench NAME] message`` lines on stderr."""
    def say(message: str) -> None:
        print(f"[bench {name}] {message}", file=sys.stderr, flush=True)
    return say


@contextlib.contextmanager
def work_dir(name: str, keep: Path | None) -> Iterator[Path]:
    """``keep`` (created if missing) or a temporary directory removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as tmp:
        root = Path(keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        yield root


def print_result(result: dict[str, Any]) -> int:
    print(json.dumps(result))
    return 0


def qwen3_shape(hidden_size: int, num_layers: int) -> dict[str, int]:
    """The random Qwen3 of a benchmark: heads of 64 dims, 4 KV heads when the heads divide by 4
    (the default 768 x 12 layers is the ~100M-parameter model of docs/benchmarks.md's figures)."""
    if hidden_size < 64 or hidden_size % 64:
        raise ValueError(f"--hidden-size must be a positive multiple of 64, got {hidden_size}")
    if num_layers < 1:
        raise ValueError(f"--num-layers must be at least 1, got {num_layers}")
    heads = hidden_size // 64
    return dict(hidden_size=hidden_size, num_hidden_layers=num_layers, intermediate_size=4 * hidden_size,
                num_attention_heads=heads, num_key_value_heads=4 if heads % 4 == 0 else heads, head_dim=64)
