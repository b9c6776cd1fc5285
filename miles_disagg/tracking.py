"""Metrics and progress output.

Metrics always go to ``<output_dir>/metrics.jsonl``: one JSON object per step with
``step`` and ``wall_time`` (seconds since the epoch), flushed and fsynced per line so a
crash loses at most the step being written. Named streams (``log_stream``) go beside it
as ``<name>.jsonl`` with the same guarantee: ``train_steps`` (one record per optimizer
step) and ``updates`` (one record per engine activation that finished after its step's
record was written). TensorBoard and wandb are added when asked for; asking for one that is
not installed is a ``ConfigError`` at start-up, not a silent skip. Progress goes to stderr,
never stdout (stdout is for results/JSON).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, TypeVar

from miles_disagg.types import ConfigError

T = TypeVar("T")
METRICS_FILENAME = "metrics.jsonl"
TRAIN_STEPS_STREAM = "train_steps"
UPDATES_STREAM = "updates"
STREAM_STEP_KEYS = {TRAIN_STEPS_STREAM: "rollout_step", UPDATES_STREAM: "step"}
"""Each stream's field naming the rollout step a record belongs to."""


class MetricsTracker:
    """Log ``{name: number}`` per step to JSONL (+ TensorBoard / wandb when enabled).

    ``start_step``: the first step this run will log (a resumed run's saved step, else 0). Records
    of that step and later left by an earlier attempt (it ran past its last save, then died) are
    dropped before anything is appended, so the file holds each step once (None: append only).

    Not thread-safe: one tracker per process, called from the driver loop.
    """

    def __init__(self, output_dir: str | Path, *, use_tensorboard: bool = False, use_wandb: bool = False,
                 wandb_project: str | None = None, wandb_group: str | None = None, wandb_team: str | None = None,
                 wandb_key: str | None = None, run_config: Mapping[str, Any] | None = None,
                 start_step: int | None = None):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILENAME
        if start_step is not None:
            keep_steps_before(self.path, start_step)
            for stream, key in STREAM_STEP_KEYS.items():
                keep_steps_before(self.output_dir / f"{stream}.jsonl", start_step, key=key)
        self._file = open(self.path, "a", encoding="utf-8")
        self._streams: dict[str, Any] = {}
        self._tensorboard = _open_tensorboard(self.output_dir) if use_tensorboard else None
        self._wandb = (_open_wandb(wandb_project, wandb_group, run_config, team=wandb_team, key=wandb_key)
                       if use_wandb else None)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record for ``step``; returns the record written."""
        record = _write_record(self._file, step, metrics)
        numeric = _numeric(record)
        self._to_tensorboard("", numeric, step)
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        return record

    def log_stream(self, name: str, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Append one record to the stream ``<output_dir>/<name>.jsonl`` (flushed and fsynced like
        ``log``); TensorBoard gets its numbers as ``<name>/<metric>`` at ``step``. Streams are not
        sent to wandb (whose step axis is the rollout step of ``log``)."""
        if name not in self._streams:
            if not name.isidentifier():
                raise ValueError(f"stream name {name!r} must be an identifier")
            self._streams[name] = open(self.output_dir / f"{name}.jsonl", "a", encoding="utf-8")
        record = _write_record(self._streams[name], step, metrics)
        self._to_tensorboard(f"{name}/", _numeric(record), step)
        return record

    def _to_tensorboard(self, prefix: str, numeric: dict[str, float], step: int) -> None:
        if self._tensorboard is None:
            return
        for name, value in numeric.items():
            self._tensorboard.add_scalar(prefix + name, value, step)
        self._tensorboard.flush()

    def close(self) -> None:
        self._file.close()
        for stream in self._streams.values():
            stream.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()

    def __enter__(self) -> "MetricsTracker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _write_record(file, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
    record = {"step": int(step), "wall_time": time.time()}
    record.update({name: _jsonable(value) for name, value in metrics.items()})
    file.write(json.dumps(record, sort_keys=False) + "\n")
    file.flush()
    os.fsync(file.fileno())
    return record


def _numeric(record: Mapping[str, Any]) -> dict[str, float]:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "wall_time")}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Read a metrics.jsonl back: one record per step, in step order (the last one written wins
    if a step appears twice); a torn line left by a crash is skipped."""
    by_step = {record["step"]: record for record in _read_all(Path(path))}
    return [by_step[step] for step in sorted(by_step)]


def _read_all(path: Path) -> list[dict[str, Any]]:
    """Every well-formed record of a JSONL file, in file order (torn lines skipped)."""
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def keep_steps_before(path: Path, start_step: int, *, key: str = "step") -> None:
    """Rewrite ``path`` (atomically) without records whose rollout step (``key``) is ``start_step`` or
    later; no file: nothing."""
    if not path.exists():
        return
    kept = [r for r in _read_all(path) if r.get(key, r["step"]) < start_step]
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def progress(items: Iterable[T], *, desc: str, total: int | None = None, unit: str = "it") -> Iterator[T]:
    """A progress bar on stderr for long work (quiet when stderr is not a terminal, except a final line)."""
    from tqdm import tqdm

    interactive = sys.stderr.isatty()
    bar = tqdm(items, desc=desc, total=total, unit=unit, file=sys.stderr, disable=not interactive,
               dynamic_ncols=True, leave=interactive)
    count = 0
    start = time.monotonic()
    for item in bar:
        count += 1
        yield item
    if not interactive:
        print(f"{desc}: {count} {unit} in {time.monotonic() - start:.1f}s", file=sys.stderr)


def status(message: str) -> None:
    """One progress line on stderr."""
    print(f"[miles-disagg {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)  # JSON has no NaN/inf
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value)


def _open_tensorboard(output_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--use-tensorboard: tensorboard is not installed (pip install tensorboard)",
                          ("--use-tensorboard",)) from None
    return SummaryWriter(log_dir=str(output_dir / "tensorboard"))


def _open_wandb(project: str | None, group: str | None, run_config: Mapping[str, Any] | None, *,
                team: str | None = None, key: str | None = None):
    """A wandb run (``team``: the entity, miles' ``--wandb-team``; ``key``: logged in with it first)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--use-wandb: wandb is not installed (pip install wandb)", ("--use-wandb",)) from None
    if key:
        wandb.login(key=key, relogin=True)
    return wandb.init(project=project, group=group, entity=team, config=dict(run_config or {}))
