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
from dataclasses import dataclass
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
                 start_step: int | None = None, wandb_options: "WandbOptions | None" = None,
                 tensorboard_dir: str | Path | None = None):
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / METRICS_FILENAME
        if start_step is not None:
            keep_steps_before(self.path, start_step)
            for stream, key in STREAM_STEP_KEYS.items():
                keep_steps_before(self.output_dir / f"{stream}.jsonl", start_step, key=key)
        self._file = open(self.path, "a", encoding="utf-8")
        self._streams: dict[str, Any] = {}
        self._tensorboard = (_open_tensorboard(Path(tensorboard_dir or self.output_dir / "tensorboard"))
                             if use_tensorboard else None)
        options = wandb_options or WandbOptions(project=wandb_project, group=wandb_group, team=wandb_team, key=wandb_key)
        self._wandb = open_wandb(options, run_config, self.output_dir) if use_wandb else None

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

    def rewind(self, start_step: int) -> None:
        """Drop the records of ``start_step`` and later from ``metrics.jsonl`` and the step-keyed
        streams, as a resumed run's tracker does at start: a restarted trainer runs those steps
        again (``loop/trainer_restart.py``). Records go on being appended after it. (TensorBoard
        and wandb cannot take points back: they get the steps run again as new points.)"""
        self._file.close()
        keep_steps_before(self.path, start_step)
        self._file = open(self.path, "a", encoding="utf-8")
        for stream, key in STREAM_STEP_KEYS.items():
            handle = self._streams.pop(stream, None)
            if handle is not None:
                handle.close()
            keep_steps_before(self.output_dir / f"{stream}.jsonl", start_step, key=key)

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


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a stream, in file order, steps repeated or not (no file: none)."""
    path = Path(path)
    return _read_all(path) if path.exists() else []


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


def _open_tensorboard(log_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--use-tensorboard: tensorboard is not installed (pip install tensorboard, or "
                          "./scripts/setup.sh, which installs the tracking extra)", ("--use-tensorboard",)) from None
    return SummaryWriter(log_dir=str(log_dir))


def tensorboard_dir(run_dir: str | Path, project: str | None, experiment: str | None) -> Path:
    """Where TensorBoard events go, with miles' ``--tb-project-name`` / ``--tb-experiment-name`` meaning:
    ``<project>/<experiment>``; the project defaults to ``$TENSORBOARD_DIR``, else the run directory's
    ``tensorboard/`` (then without an experiment level unless one is named); the experiment defaults to
    the run directory's name."""
    run_dir = Path(run_dir)
    root = project or os.environ.get("TENSORBOARD_DIR")
    if root is None:
        return run_dir / "tensorboard" / experiment if experiment else run_dir / "tensorboard"
    return Path(root) / (experiment or run_dir.resolve().name)


@dataclass(frozen=True)
class WandbOptions:
    """miles' wandb flags: ``--wandb-project``, ``-group``, ``-team`` (entity), ``-key``, ``-host`` (server
    URL), ``-mode`` (online | offline | disabled; None: ``WANDB_MODE`` or online), ``-dir`` (None: the run
    directory), ``-run-id`` (resume or create that run) and ``--disable-wandb-random-suffix``."""

    project: str | None = None
    group: str | None = None
    team: str | None = None
    key: str | None = None
    host: str | None = None
    mode: str | None = None
    dir: str | None = None
    run_id: str | None = None
    random_suffix: bool = True

    def run_name(self, run_dir: Path, suffix: str) -> str:
        """The group (or the run directory's name), plus ``_`` and ``suffix`` unless the suffix is disabled."""
        base = self.group or run_dir.resolve().name
        return f"{base}_{suffix}" if self.random_suffix else base


def open_wandb(options: WandbOptions, run_config: Mapping[str, Any] | None, run_dir: Path):
    """A wandb run with miles' flags' meanings (logged in with the key first, against the host if given)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError("--use-wandb: wandb is not installed (pip install wandb, or ./scripts/setup.sh, which "
                          "installs the tracking extra)", ("--use-wandb",)) from None
    if options.key:
        login = {"key": options.key, "relogin": True}
        if options.host:
            login["host"] = options.host
        wandb.login(**login)
    kwargs: dict[str, Any] = {"project": options.project, "group": options.group, "entity": options.team,
                              "config": dict(run_config or {})}
    optional = {"mode": options.mode, "dir": str(options.dir or run_dir), "id": options.run_id,
                "resume": "allow" if options.run_id else None,
                "name": options.run_name(run_dir, _random_suffix()) if (options.group or options.run_id is None) else None,
                "settings": wandb.Settings(base_url=options.host) if options.host else None}
    kwargs.update({name: value for name, value in optional.items() if value is not None})
    return wandb.init(**kwargs)


def _random_suffix() -> str:
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(6))


def pass_at_k(rewards_per_group: Iterable[Iterable[float]]) -> dict[str, float]:
    """miles' ``--log-passrate``: ``rollout/pass@k`` for k = 1, 2, 4, ... up to the group size, a sample
    passing when its reward is 1; per group the unbiased estimate ``1 - C(n - c, k) / C(n, k)``, then the
    mean over groups (groups smaller than k are left out of that k)."""
    groups = [[float(r) for r in rewards] for rewards in rewards_per_group]
    groups = [g for g in groups if g]
    if not groups:
        return {}
    metrics = {}
    k = 1
    while k <= max(len(g) for g in groups):
        estimates = [_pass_at_k(len(g), sum(r == 1.0 for r in g), k) for g in groups if len(g) >= k]
        metrics[f"rollout/pass@{k}"] = sum(estimates) / len(estimates)
        k *= 2
    return metrics


def _pass_at_k(n: int, correct: int, k: int) -> float:
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)
