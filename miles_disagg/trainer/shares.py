"""The split of a rollout's samples into optimizer steps, ranks' shares and micro-batches.

Pure Python on :class:`~miles_disagg.samples.Sample` lists: the driver splits a rollout here without
importing torch (packing into tensors is :mod:`miles_disagg.trainer.batches`, on the ranks).
"""

from __future__ import annotations

from typing import Sequence

from miles_disagg.samples import Sample


def split_for_steps(samples: Sequence[Sample], global_batch_size: int, world_size: int,
                    balance: bool = False) -> list[list[list[Sample]]]:
    """``samples`` -> ``[step][rank] -> samples``: consecutive global batches, each dealt round-robin to
    ranks, or (``balance``, miles' ``--balance-data``) so each rank's share has a similar token total.

    ``ValueError`` when the samples do not fill whole global batches or a global batch does not
    divide over the ranks (the config validation prevents both for a normal run).
    """
    if global_batch_size % world_size:
        raise ValueError(f"global batch {global_batch_size} does not divide over {world_size} trainer ranks")
    if len(samples) % global_batch_size:
        raise ValueError(f"{len(samples)} samples are not a whole number of global batches of {global_batch_size}")
    steps = []
    for start in range(0, len(samples), global_batch_size):
        chunk = samples[start:start + global_batch_size]
        steps.append(balanced_shares(chunk, world_size) if balance else
                     [list(chunk[rank::world_size]) for rank in range(world_size)])
    return steps


def balanced_shares(samples: Sequence[Sample], world_size: int) -> list[list[Sample]]:
    """Equal-count shares with similar token totals: longest sample first, each to the share with
    the fewest tokens that still has room (greedy; each share keeps the samples' order)."""
    per_rank = len(samples) // world_size
    tokens = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    totals, members = [0] * world_size, [[] for _ in range(world_size)]
    for index in sorted(range(len(samples)), key=lambda i: (-tokens[i], i)):
        rank = min((r for r in range(world_size) if len(members[r]) < per_rank), key=lambda r: (totals[r], r))
        members[rank].append(index)
        totals[rank] += tokens[index]
    return [[samples[i] for i in sorted(share)] for share in members]


def micro_batches(samples: Sequence[Sample], micro_batch_size: int) -> list[list[Sample]]:
    return [list(samples[i:i + micro_batch_size]) for i in range(0, len(samples), micro_batch_size)]
