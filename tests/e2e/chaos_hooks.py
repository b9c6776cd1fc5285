"""The chaos run's reward (``--custom-rm-path chaos_hooks.reward``): the count-up task's own reward,
with a gate that keeps the run from finishing before the chaos is over.

Once the rollout manager has scored ``MILES_DISAGG_CHAOS_GATE_AFTER`` samples, each further
score waits while the file ``MILES_DISAGG_CHAOS_HOLD`` exists (the test removes it when its
faults are done). Before that, and whenever the file is gone, it is only the task's reward: the
faults happen while generation runs as usual.
"""

from __future__ import annotations

import asyncio
import os

from miles_disagg.rollout.tasks import count_up_reward

_scored = 0


async def reward(args, sample, **kwargs) -> float:
    global _scored
    _scored += 1
    hold = os.environ.get("MILES_DISAGG_CHAOS_HOLD")
    gate_after = int(os.environ.get("MILES_DISAGG_CHAOS_GATE_AFTER", "0"))
    while hold and _scored > gate_after and os.path.exists(hold):
        await asyncio.sleep(0.2)
    return count_up_reward(sample.prompt, sample.response, sample.label, sample.metadata)
