"""Where a sample carries the critic's values (PPO), between the critic's group and the policy's.

The driver asks the critic for each sample's value of every response token and attaches them
to the sample (miles' rollout-data key ``values``); the policy's ranks pack them
(``PackedBatch.values``) for GAE, and the critic's ranks train against them as the old values.
A sample takes free attributes (``samples.Sample``): the values travel with it through Ray.
Torch-free, as the driver is.
"""

from __future__ import annotations

from typing import Sequence

ATTRIBUTE = "critic_values"


def attach_values(sample, values: Sequence[float]) -> None:
    """Give ``sample`` the critic's value of each of its response tokens (``ValueError`` on a length mismatch)."""
    if len(values) != len(sample.response_ids):
        raise ValueError(f"{len(values)} critic values for a response of {len(sample.response_ids)} tokens")
    setattr(sample, ATTRIBUTE, [float(v) for v in values])


def values_of(sample) -> list[float] | None:
    """The critic's values ``sample`` carries (None: none attached)."""
    return getattr(sample, ATTRIBUTE, None)
