"""``miles-disagg report RUN_DIR``: rebuild ``summary.json`` and ``report.png`` of a run directory
from its records (``metrics.jsonl`` and the ``updates`` stream), at any time: after a run that
was interrupted or killed, while one is running, or after the report's format changed.

Prints the run summary on stderr, as the end of a run does. A directory without records, or
records that are too large or malformed to summarize, exit 2 with one line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from miles_disagg.config.commands import add_config_arguments, config_from_args
from miles_disagg.config.fields import REQUIRED, flag
from miles_disagg.types import InvalidInput

MAX_RECORDS_BYTES = 1 << 30  # one line per step: a larger file is not a run's metrics


@dataclass(kw_only=True)
class ReportCommand:
    """Rebuild summary.json and report.png of a run directory from its records."""

    run_dir: str = flag(REQUIRED, "A run directory (--run-dir of train.py / train_async.py) holding metrics.jsonl.",
                        positional=True, metavar="RUN_DIR")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, ReportCommand)


def run(args: argparse.Namespace) -> int:
    rebuild(Path(config_from_args(ReportCommand, args).run_dir))
    return 0


def rebuild(run_dir: Path) -> dict:
    """The summary written (``InvalidInput`` for what is not a run directory with records)."""
    from miles_disagg.loop.report import write_report
    from miles_disagg.tracking import METRICS_FILENAME, UPDATES_STREAM

    if not run_dir.is_dir():
        raise InvalidInput(f"{str(run_dir)!r} is not a directory")
    metrics = run_dir / METRICS_FILENAME
    if not metrics.is_file():
        raise InvalidInput(f"{str(run_dir)!r} has no {METRICS_FILENAME}: not a run directory, or its run "
                           "logged no step yet")
    for path in (metrics, run_dir / f"{UPDATES_STREAM}.jsonl"):
        if path.is_file() and path.stat().st_size > MAX_RECORDS_BYTES:
            raise InvalidInput(f"{path} is larger than {MAX_RECORDS_BYTES >> 20} MiB: not a run's records")
    try:
        return write_report(run_dir)
    except (TypeError, ValueError, KeyError, OverflowError, AttributeError) as exc:
        raise InvalidInput(f"{str(run_dir)!r}: its records cannot be summarized ({type(exc).__name__}: {exc})") \
            from None
