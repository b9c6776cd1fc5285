"""No wait of the driver longer than a few seconds is silent (issue 29): ``still(...)`` prints a line
every interval while its block runs, and nothing once it ended."""

from __future__ import annotations

import threading

from miles_disagg.loop.waiting import still


def test_a_line_every_interval_while_the_block_runs(capsys) -> None:
    released = threading.Event()
    with still("starting the engines", every_s=0.05):
        released.wait(0.3)
    lines = [line for line in capsys.readouterr().err.splitlines() if "still starting the engines (" in line]
    assert len(lines) >= 2
    released.wait(0.2)
    assert "still" not in capsys.readouterr().err  # the block ended: quiet


def test_a_short_block_says_nothing(capsys) -> None:
    with still("starting the trainer", every_s=5.0):
        pass
    assert capsys.readouterr().err == ""
