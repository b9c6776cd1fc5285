"""SIGINT / SIGTERM during a run: the run stops cleanly and says where it stopped.

While :func:`catching_interrupts` is active, SIGTERM is raised in the main thread like SIGINT
(as :class:`RunInterrupted`, a ``KeyboardInterrupt``), so the loops' ``finally`` blocks stop
the job (actors, engines, Ray) on either. :func:`report_interruption` then writes
``summary.json`` and ``report.png`` for the completed steps and prints one line: the step the
run was at and, when saves exist, the ``--load`` that resumes it. Exit status 128 + signal
number (130 for SIGINT, 143 for SIGTERM), as a shell reports a process ended by the signal.
"""

from __future__ import annotations

import contextlib
import io
import signal
import threading
from pathlib import Path
from typing import Iterator

from miles_disagg.config.components import RunConfig
from miles_disagg.loop.run_files import REPORT_FILENAME, SUMMARY_FILENAME


class RunInterrupted(KeyboardInterrupt):
    """The run got ``signum`` (SIGINT or SIGTERM)."""

    def __init__(self, signum: int = signal.SIGINT):
        super().__init__(int(signum))
        self.signum = int(signum)

    def __reduce__(self):
        return (type(self), (self.signum,))


def interrupted_by(received: list[int], exc: BaseException) -> KeyboardInterrupt | None:
    """The interruption ``exc`` stands for: itself, or (an error raised after a signal arrived)
    the first signal's; None for an error of a run no signal reached."""
    if isinstance(exc, KeyboardInterrupt):
        return exc
    return RunInterrupted(received[0]) if received else None


def exit_status(exc: KeyboardInterrupt) -> int:
    return 128 + getattr(exc, "signum", int(signal.SIGINT))


@contextlib.contextmanager
def catching_interrupts() -> Iterator[list[int]]:
    """SIGINT and SIGTERM raise :class:`RunInterrupted` in the main thread; the first one only:
    while the run tears down, a second is noted and ignored, so the stop is not cut short
    (a third restores the default, for a run that will not stop).

    Yields the signals received: Ctrl-C reaches the run's whole process group, so an engine or a
    worker may die of it and its error reach the driver before the driver's own interrupt does;
    the caller treats any error after a signal as that interruption (:func:`interrupted_by`)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handler(signum, frame):
        received.append(signum)
        if len(received) == 1:
            raise RunInterrupted(signum)
        if len(received) == 2:
            from miles_disagg.tracking import status

            status("still stopping the run (engines, trainer, Ray); interrupt once more to exit at once")
            return
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise RunInterrupted(signum)

    global _active_handler
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    _active_handler = handler
    try:
        yield received
    finally:
        _active_handler = None
        for s, h in previous.items():
            signal.signal(s, h)


_active_handler = None


def reclaim_sigterm() -> None:
    """After ``ray.init``, which sets its own SIGTERM handler in the driver (``sys.exit``): the run's
    handler again, so SIGTERM stops the run as SIGINT does."""
    if _active_handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _active_handler)


def report_interruption(config: RunConfig, exc: KeyboardInterrupt) -> str:
    """Write the report of the completed steps (quietly) and return the one line to print."""
    from miles_disagg.loop.report import run_end, write_report
    from miles_disagg.tracking import METRICS_FILENAME, read_metrics

    run_dir = Path(config.tracking.run_dir)
    metrics = run_dir / METRICS_FILENAME
    records = read_metrics(metrics) if metrics.exists() else []
    step = records[-1]["step"] + 1 if records else 0
    name = signal.Signals(exit_status(exc) - 128).name
    line = f"interrupted ({name}) at step {step}"
    if records:
        try:
            with contextlib.redirect_stderr(io.StringIO()):  # the summary block: one line is what is asked
                write_report(run_dir, end=run_end(exc))
            line += f"; {SUMMARY_FILENAME} and {REPORT_FILENAME} of steps before {step} in {run_dir}"
        except Exception as error:  # noqa: BLE001 - the run is over either way: say why there is no report
            line += f"; no report ({type(error).__name__}: {error}; see miles-disagg report {run_dir})"
    resume = _resume_from(config)
    if resume:
        line += f"; resume with --load {resume}"
    return line


def _resume_from(config: RunConfig) -> str | None:
    from miles_disagg.trainer.checkpoint import find_latest

    save = config.train.save
    if save and find_latest(save) is not None:
        return save
    return None
