"""Deadlines of whole runs that hold on a busy machine, while a hang still fails.

A whole run's time grows with the machine's load, by more than the load per core: with two other
processes keeping both cores busy, the suite's whole runs took about three times their quiet time
(2026-12-04: the two busy loops held 68% of each core, since the kernel shares a core among the
runnable processes and a busy loop is always runnable, while a run's processes also wait on each
other). Each deadline here is its quiet-machine value times ``LOAD_FACTOR``: 1 + ``LOAD_WEIGHT``
times the others' load per core, at most ``MAX_LOAD_FACTOR`` (so a hang still fails, within at
most that multiple of the quiet deadline). The quiet values already hold for the suite's own load.

The others' load is measured before the suite starts: ``scripts/test.sh`` runs this file, which
takes the larger of the load average (1 and 5 minutes: load that ended recently counts) and the
processes runnable now (load that started recently: the load average lags it by a minute), and
passes the factor to every test process in ``MILES_DISAGG_TEST_LOAD_FACTOR`` (set it to choose the
factor yourself). A test process started without it measures the load average when it starts.
"""

from __future__ import annotations

import os
import time

MAX_LOAD_FACTOR = 4.0
LOAD_WEIGHT = 2.0
LOAD_FACTOR_ENV = "MILES_DISAGG_TEST_LOAD_FACTOR"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def factor_for(load: float, cores: int) -> float:
    """The deadline multiple for ``load`` runnable processes besides the suite on ``cores`` cores."""
    return min(MAX_LOAD_FACTOR, 1.0 + LOAD_WEIGHT * max(0.0, load) / max(1, cores))


def runnable_others(samples: int = 10, interval_s: float = 0.1) -> float:
    """Processes runnable now besides this one: the median of ``samples`` readings of
    ``/proc/stat``'s ``procs_running`` (0 where there is no such file)."""
    readings = []
    for _ in range(samples):
        try:
            with open("/proc/stat") as stat:
                running = next(int(line.split()[1]) for line in stat if line.startswith("procs_running "))
        except (OSError, StopIteration, ValueError):
            return 0.0
        readings.append(running - 1)  # this process
        time.sleep(interval_s)
    return float(sorted(readings)[len(readings) // 2])


def measure_load_factor(include_runnable: bool = False) -> float:
    given = os.environ.get(LOAD_FACTOR_ENV)
    if given:
        return min(MAX_LOAD_FACTOR, max(1.0, float(given)))
    load1, load5, _ = os.getloadavg()
    load = max(load1, load5, runnable_others() if include_runnable else 0.0)
    return factor_for(load, _cores())


LOAD_FACTOR = measure_load_factor()


def scaled(quiet_s: float) -> float:
    """``quiet_s`` (a deadline that holds on a quiet machine) for this machine's load now."""
    return quiet_s * LOAD_FACTOR


if __name__ == "__main__":  # scripts/test.sh: the factor for the suite it is about to start
    print(f"{measure_load_factor(include_runnable=True):.2f}")
