"""The chaos run's reward (``--custom-rm-path chaos_hooks.reward``): the count-up task's own reward,
behind a gate the test paces the run with.

The file ``MILES_DISAGG_CHAOS_GATE`` holds how many samples may be scored so far; a score past
that waits until the test raises the number or removes the file (no limit then). The tiny run
takes well under a second per step on its own: without the gate it would finish before the
test's faults are done, and with the gate generation still runs during each fault.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from miles_disagg.rollout.tasks import count_up_reward

_scored = 0


def _budget(gate: str) -> float:
    try:
        return int(Path(gate).read_text())
    except FileNotFoundError:
        return float("inf")
    except ValueError:  # read while the test rewrote it: ask again
        return _scored


async def reward(args, sample, **kwargs) -> float:
    global _scored
    gate = os.environ.get("MILES_DISAGG_CHAOS_GATE")
    while gate and _scored >= _budget(gate):
        await asyncio.sleep(0.2)
    _scored += 1
    return count_up_reward(sample.prompt, sample.response, sample.label, sample.metadata)
