"""The attribution check of whole runs: every consumed sample served by one version recomputes, with
that version's weights (materialized from the run's store), to the logprobs the engine reported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable


def samples_by_version(consumed_dir: Path, steps: int) -> dict[int, list[dict]]:
    """``--save-debug-rollout-data <dir>/{rollout_id}.jsonl``'s samples served by one version, by version."""
    by_version: dict[int, list[dict]] = {}
    for step in range(steps):
        for group in map(json.loads, (consumed_dir / f"{step}.jsonl").read_text().splitlines()):
            for sample in group["samples"]:
                if sample["weight_version_start"] == sample["weight_version_end"]:
                    by_version.setdefault(sample["weight_version_start"], []).append(sample)
    return by_version


def count_misattributed(by_version: dict[int, list[dict]], store_of: Callable[[int], str], base_dir: Path,
                        local_dir: Path) -> tuple[int, int]:
    """``(misattributed, checked)`` over the samples (temperature 1.0: logprobs are the model's own)."""
    import torch
    from transformers import AutoModelForCausalLM

    from miles_disagg.weights.materializer import Materializer

    host = Materializer(local_dir, base_dir=base_dir)
    misattributed, checked = 0, 0
    try:
        for version in sorted(by_version):
            path = host.prepare(store_of(version), version).path if version else base_dir
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for sample in by_version[version]:
                prompt, response = sample["prompt_ids"], sample["response_ids"]
                with torch.no_grad():
                    logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
                logprobs = torch.log_softmax(logits, dim=-1)
                diffs = [abs(float(logprobs[len(prompt) - 1 + i, token]) - sample["response_logprobs"][i])
                         for i, token in enumerate(response)]
                misattributed += max(diffs) > 1e-3
                checked += 1
    finally:
        host.close()
    return misattributed, checked
