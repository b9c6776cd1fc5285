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


def test_the_line_says_what_is_awaited_now_and_a_failed_read_leaves_it_short(capsys) -> None:
    released = threading.Event()
    answers = iter(["0 of 2 engine(s) serving"])

    def detail() -> str:
        return next(answers)  # then StopIteration: a read that failed

    with still("waiting for 4 groups from the rollout", every_s=0.05, detail=detail):
        released.wait(0.3)
    lines = [line for line in capsys.readouterr().err.splitlines() if "still waiting for 4 groups" in line]
    assert lines[0].endswith("s): 0 of 2 engine(s) serving") and lines[-1].endswith("s)"), lines
