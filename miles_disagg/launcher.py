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
from pathlib import Path
from typing import Iterator, Sequence

from miles_disagg.config import RunConfig, config_to_yaml
from miles_disagg.config.loader import load_launch
from miles_disagg.loop.preflight import check_runnable, make_paths_absolute, prepare_run
from miles_disagg.loop.run_lock import RunDirLock
from miles_disagg.types import ConfigError, MilesDisaggError

EXIT_FAILED = 1
EXIT_CONFIG_ERROR = 2


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


@contextlib.contextmanager
def run_locks(config: RunConfig) -> Iterator[None]:
    """The run directory's lock and, for a version store or a ``--save`` directory outside it that
    this machine sees, theirs: a second run publishing into the same store would reset it (a new
    run takes a store over) under the first, and its saves would mix with the first's."""
    with contextlib.ExitStack() as locks:
        run_dir = Path(config.tracking.run_dir)
        locks.enter_context(RunDirLock.acquire(run_dir))
        for flag, path in _shared_outputs(config):
            if not path.is_relative_to(run_dir) and path.parent.is_dir():  # else: not seen from here
                locks.enter_context(RunDirLock.acquire(path, flag=flag))
        yield


def _shared_outputs(config: RunConfig) -> list[tuple[str, Path]]:
    outputs = []
    store = config.weights.update_weight_disk_dir
    if config.weights.update_weight_transfer_mode == "disk-delta" and store and not config.rollout.debug_rollout_only:
        outputs.append(("--update-weight-disk-dir", Path(store)))
    if config.train.save and not config.rollout.debug_rollout_only:
        outputs.append(("--save", Path(config.train.save)))
    return outputs


def run_training(config: RunConfig, entry: str = "train") -> int:
    from miles_disagg.loop.interrupts import catching_interrupts, exit_status, report_interruption
    from miles_disagg.loop.train_loops import run

    try:
        with catching_interrupts():
            prepare_run(config)
            run(config)
    except KeyboardInterrupt as exc:
        print(f"{entry}.py: {report_interruption(config, exc)}", file=sys.stderr)
        return exit_status(exc)
    return 0


def _cause(exc: BaseException) -> BaseException:
    """The original error of one raised inside a Ray actor (Ray wraps it with its traceback)."""
    return getattr(exc, "cause", None) or exc
