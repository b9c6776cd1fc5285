"""Deadlines of whole runs that hold on a busy machine, while a hang still fails.

A whole run's time grows with the machine's load: with two other processes keeping both cores
busy, the e2e runs took two to three times their quiet time and fixed deadlines failed. Each
deadline here is its quiet-machine value times ``LOAD_FACTOR``, measured when the test process
starts: 1 + the load average per core (the larger of the 1- and 5-minute ones: load that started
recently or ended recently both count), at most ``MAX_LOAD_FACTOR`` (so a hang still fails, within
at most that multiple of the quiet deadline). The quiet values already hold for the suite's own
load (its workers start with it, after the measurement): what is measured is everyone else's.
``MILES_DISAGG_TEST_LOAD_FACTOR`` sets the factor instead (e.g. on a machine whose load average
does not show who shares it).
"""

from __future__ import annotations

import os

MAX_LOAD_FACTOR = 4.0
LOAD_FACTOR_ENV = "MILES_DISAGG_TEST_LOAD_FACTOR"


def measure_load_factor() -> float:
    given = os.environ.get(LOAD_FACTOR_ENV)
    if given:
        return min(MAX_LOAD_FACTOR, max(1.0, float(given)))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    load1, load5, _ = os.getloadavg()
    return min(MAX_LOAD_FACTOR, 1.0 + max(load1, load5) / max(1, cores))


LOAD_FACTOR = measure_load_factor()


def scaled(quiet_s: float) -> float:
    """``quiet_s`` (a deadline that holds on a quiet machine) for this machine's load now."""
    return quiet_s * LOAD_FACTOR
