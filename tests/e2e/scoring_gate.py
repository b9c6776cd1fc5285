"""A reward behind a gate the test paces a whole run with (``--custom-rm-path scoring_gate.reward``,
this directory on ``PYTHONPATH``): the count-up task's own reward.

The file named by ``MILES_DISAGG_REWARD_GATE`` holds how many samples may be scored so far; a score
past that waits until the test raises the number (:func:`allow`) or removes the file (no limit
then). A tiny run takes well under a second per step on its own: without the gate it could finish
before the test's faults or membership changes are done; with it, generation still runs while the
test acts. Used by the chaos run and the elastic-membership run.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from miles_disagg.rollout.tasks import count_up_reward

GATE_ENV = "MILES_DISAGG_REWARD_GATE"
_scored = 0


def allow(gate: Path, samples: int) -> None:
    """The test's side: let ``samples`` more samples be scored (the file is replaced whole)."""
    allowed = int(gate.read_text()) if gate.exists() else 0
    gate.with_suffix(".new").write_text(str(allowed + samples))
    gate.with_suffix(".new").replace(gate)


def _budget(gate: str) -> float:
    try:
        return int(Path(gate).read_text())
    except FileNotFoundError:
        return float("inf")
    except ValueError:  # read while the test rewrote it: ask again
        return _scored


async def reward(args, sample, **kwargs) -> float:
    global _scored
    gate = os.environ.get(GATE_ENV)
    while gate and _scored >= _budget(gate):
        await asyncio.sleep(0.2)
    _scored += 1
    return count_up_reward(sample.prompt, sample.response, sample.label, sample.metadata)
