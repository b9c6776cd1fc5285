"""``miles_disagg.startup``: a process's first seconds run without the cyclic garbage collector, which
comes back on by itself; a process that turned it off itself keeps it off."""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_importing_the_package_turns_the_collector_off_for_the_start_up_seconds() -> None:
    out = run("import gc, threading, miles_disagg\n"
              "from miles_disagg.startup import STARTUP_S\n"
              "timer = next(t for t in threading.enumerate() if t.name == 'miles-disagg-gc-after-startup')\n"
              "print(gc.isenabled(), timer.daemon, timer.interval == STARTUP_S)")
    assert out == "False True True"


def test_the_collector_comes_back_on_after_them() -> None:
    out = run("import gc, time\n"
              "from miles_disagg import startup\n"
              "startup._started = False; gc.enable()\n"
              "startup.start_without_cyclic_gc(0.2)\n"
              "off = not gc.isenabled()\n"
              "deadline = time.monotonic() + 30\n"
              "while not gc.isenabled() and time.monotonic() < deadline: time.sleep(0.05)\n"
              "print(off, gc.isenabled())")
    assert out == "True True"


def test_a_process_that_turned_the_collector_off_itself_is_left_as_it_is() -> None:
    out = run("import gc, threading\n"
              "gc.disable()\n"
              "import miles_disagg\n"
              "print(gc.isenabled(), any(t.name == 'miles-disagg-gc-after-startup' for t in threading.enumerate()))")
    assert out == "False False"
