"""``--cpu-durations=N``: the N tests that cost the most CPU time, their processes included.

Wall time says little on a shared machine (a test waits for cores others hold); CPU seconds say
what a test costs. Each test process (an xdist worker, or the one process) marks its environment
with a tag of its own, which every process it starts inherits (a run's driver, its Ray, its
engines, and the daemons of ``ray start``). A sampling thread reads the CPU time of every tagged
process twice a second; a test's phase (setup, call, teardown) is charged the tagged processes'
CPU time spent while it ran, plus the test process's own. A process that lives less than the
sampling interval is missed, and one that dies loses its last half second: the figures are a
lower bound, comparable between runs. Linux only (``/proc``); elsewhere the option does nothing.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

TAG_ENV = "MILES_DISAGG_TEST_CPU_TAG"
SAMPLE_INTERVAL_S = 0.5
CPU_PROPERTY = "cpu_s"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="show the N tests (and test files) that used the most CPU time, their processes included")


class TaggedProcesses:
    """CPU seconds of every process whose environment carries ``TAG_ENV=tag`` (this one excluded)."""

    def __init__(self, tag: str):
        self.tag = f"{TAG_ENV}={tag}".encode()
        self._kind: dict[tuple[int, str], bool] = {}  # (pid, start time) -> tagged?
        self._cpu: dict[tuple[int, str], float] = {}  # last CPU seconds seen of each tagged process
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-durations", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def total_s(self) -> float:
        """CPU seconds of the tagged processes so far (a sample taken now)."""
        self.sample()
        with self._lock:
            return sum(self._cpu.values())

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_INTERVAL_S):
            self.sample()

    def sample(self) -> None:
        me = os.getpid()
        seen: dict[tuple[int, str], float] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == me:
                continue
            try:
                fields = Path(entry.path, "stat").read_bytes().rsplit(b")", 1)[1].split()
                key = (int(entry.name), fields[19].decode())  # the start time tells a reused pid apart
                if key not in self._kind:
                    self._kind[key] = self.tag in Path(entry.path, "environ").read_bytes().split(b"\0")
                if self._kind[key]:
                    seen[key] = (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
            except (OSError, IndexError, ValueError):
                continue
        with self._lock:
            self._cpu.update(seen)


class CpuDurations:
    """The plugin: charges each test phase its CPU seconds (on the process that runs it) and prints
    the most costly tests and files (on the controller)."""

    def __init__(self, config: pytest.Config, top: int):
        self.config, self.top = config, top
        self.by_test: dict[str, float] = defaultdict(float)
        self.processes: TaggedProcesses | None = None
        if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
            tag = uuid.uuid4().hex[:12]  # a process that runs tests (not xdist's controller)
            os.environ[TAG_ENV] = tag
            self.processes = TaggedProcesses(tag)
            self.processes.start()

    def _now(self) -> float:
        return time.process_time() + self.processes.total_s()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        yield from self._charge(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        yield from self._charge(item)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item):
        yield from self._charge(item)

    def _charge(self, item: pytest.Item):
        if self.processes is None:
            yield
            return
        started = self._now()
        yield
        item.stash.setdefault(_PHASE_CPU, []).append(self._now() - started)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call):
        outcome = yield
        report = outcome.get_result()
        phases = item.stash.get(_PHASE_CPU, [])
        if phases:
            report.user_properties.append((CPU_PROPERTY, round(phases[-1], 2)))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Each phase's report carries its CPU seconds (xdist sends it from the worker)."""
        if not hasattr(self.config, "workerinput"):
            self.by_test[report.nodeid] += sum(v for name, v in report.user_properties if name == CPU_PROPERTY)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if hasattr(self.config, "workerinput"):
            return
        by_file: dict[str, float] = defaultdict(float)
        for nodeid, seconds in self.by_test.items():
            by_file[nodeid.split("::", 1)[0]] += seconds
        write = terminalreporter.write_line
        terminalreporter.section(f"the {self.top} tests using the most CPU (seconds, their processes included)")
        for nodeid, seconds in sorted(self.by_test.items(), key=lambda kv: -kv[1])[:self.top]:
            write(f"{seconds:9.1f}  {nodeid}")
        write(f"{sum(self.by_test.values()):9.1f}  in all ({len(self.by_test)} tests)")
        terminalreporter.section("CPU seconds per test file")
        for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:self.top]:
            write(f"{seconds:9.1f}  {path}")


_PHASE_CPU = pytest.StashKey[list]()


def pytest_configure(config: pytest.Config) -> None:
    top = config.getoption("--cpu-durations")
    if top is not None and Path("/proc/self/environ").exists():
        config.pluginmanager.register(CpuDurations(config, top), "cpu-durations")
