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
