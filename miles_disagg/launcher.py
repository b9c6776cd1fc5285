"""What ``train.py`` and ``train_async.py`` run: resolve the config, prepare, then train.

Exit codes: 0 done, 1 the run failed (one line naming the error; an unexpected internal
fault shows its traceback), 2 invalid configuration (a message naming the flags, no traceback;
also a run directory another live run holds), 130 / 143 interrupted by SIGINT / SIGTERM (one
line; summary.json and report.png of the completed steps are written).
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Iterator, Sequence

from miles_disagg.config import RunConfig, config_to_yaml
from miles_disagg.config.loader import load_launch
from miles_disagg.loop.preflight import check_runnable, make_paths_absolute, prepare_run
from miles_disagg.loop.run_lock import RunDirLock, outputs_to_lock
from miles_disagg.types import ConfigError, MilesDisaggError

EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT; a run stopped by a signal exits 128 + its number (loop/interrupts.py)


def main(entry: str, argv: Sequence[str] | None = None) -> int:
    """Entry point of ``train.py`` (entry="train") and ``train_async.py`` (entry="train_async")."""
    try:
        config, mode = load_launch(argv, entry)
        if mode == "print-config":
            print(config_to_yaml(config), end="")
            return 0
        if mode == "dry-run":
            from miles_disagg.loop.dry_run import plan_launch

            print(json.dumps(plan_launch(config), indent=2))
            return 0
        check_runnable(config)
        make_paths_absolute(config)
        with run_locks(config):  # held until the run has ended, however it ends
            return run_training(config, entry)
    except ConfigError as exc:
        print(f"{entry}.py: error: {_cause(exc)}", file=sys.stderr)
        return EXIT_CONFIG_ERROR
    except MilesDisaggError as exc:
        print(f"{entry}.py: failed: {type(_cause(exc)).__name__}: {_cause(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:  # during the checks (e.g. waiting for an attached engine): nothing started yet
        print(f"{entry}.py: interrupted before the run started", file=sys.stderr)
        return EXIT_INTERRUPTED


@contextlib.contextmanager
def run_locks(config: RunConfig) -> Iterator[None]:
    """The locks of what the run writes (``run_lock.outputs_to_lock``), held until it has ended."""
    with contextlib.ExitStack() as locks:
        for flag, path in outputs_to_lock(config):
            locks.enter_context(RunDirLock.acquire(path, flag=flag))
        yield


def run_training(config: RunConfig, entry: str = "train") -> int:
    from miles_disagg.loop.interrupts import catching_interrupts, exit_status, interrupted_by, report_interruption
    from miles_disagg.loop.train_loops import run

    received: list[int] = []
    try:
        with catching_interrupts() as received:
            prepare_run(config)
            run(config)
    except BaseException as exc:  # noqa: BLE001 - re-raised unless a signal stopped the run
        interruption = interrupted_by(received, exc)
        if interruption is None:
            raise
        print(f"{entry}.py: {report_interruption(config, interruption)}", file=sys.stderr)
        return exit_status(interruption)
    return 0


def _cause(exc: BaseException) -> BaseException:
    """The original error of one raised inside a Ray actor (Ray wraps it with its traceback)."""
    return getattr(exc, "cause", None) or exc
