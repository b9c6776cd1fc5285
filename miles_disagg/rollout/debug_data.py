"""miles' debug rollout data: the groups a step trained on as JSON lines (``--save-debug-rollout-data``),
read back by a train-only run (``--load-debug-rollout-data``)."""

from __future__ import annotations

import json
from pathlib import Path

from miles_disagg.rollout.routed_experts import from_jsonable, to_jsonable
from miles_disagg.samples import Group, Sample
from miles_disagg.types import asdict


def save_groups(path: str | Path, groups: list[Group], consumed_at_version: int) -> None:
    """``--save-debug-rollout-data``: one JSON line per group, with the trainer version that consumed it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for g in groups:
            record = asdict(g)
            for sample, original in zip(record["samples"], g.samples):  # numpy routing as nested lists
                sample["rollout_routed_experts"] = to_jsonable(original.rollout_routed_experts)
            f.write(json.dumps({**record, "consumed_at_version": consumed_at_version}) + "\n")


def load_groups(path: str | Path) -> list[Group]:
    """``--load-debug-rollout-data``: what ``save_groups`` wrote."""
    groups = []
    for line in Path(path).read_text().splitlines():
        raw = json.loads(line)
        samples = [Sample(**{**s, "rollout_routed_experts": from_jsonable(s.get("rollout_routed_experts"))})
                   for s in raw["samples"]]
        groups.append(Group(prompt_index=raw["prompt_index"], samples=samples))
    return groups
