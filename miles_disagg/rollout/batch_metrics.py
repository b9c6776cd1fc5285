"""The rollout's metrics a batch carries to the trainer: what its samples look like, what the dynamic
filter dropped, and the request counters (pure functions over the manager's state)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from miles_disagg.samples import Group


def group_metrics(groups: list[Group]) -> dict[str, Any]:
    """Rewards, lengths, truncation and served versions of the batch's samples."""
    samples = [s for g in groups for s in g.samples]
    if not samples:
        return {}
    lengths = [len(s.response_ids) for s in samples]
    metrics = {"rollout/raw_reward": sum(s.reward for s in samples) / len(samples),
               "rollout/response_len_mean": sum(lengths) / len(lengths),
               "rollout/truncated_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
               "rollout/served_version_mean": mean(s.weight_version_end for s in samples)}
    if any(s.loss_mask is not None for s in samples):
        metrics["rollout/trained_token_ratio"] = sum(s.effective_response_length for s in samples) / sum(lengths)
        metrics["rollout/engine_calls_mean"] = mean(len(s.call_versions) for s in samples)
    return metrics


def filter_metrics(filtered: Counter[str]) -> dict[str, float]:
    """Groups the dynamic filter dropped since the previous batch (total and by reason)."""
    metrics = {"rollout/dynamic_filtered_groups": float(sum(filtered.values()))}
    metrics.update({f"rollout/dynamic_filter/drop_{reason}": float(n) for reason, n in filtered.items()})
    return metrics


def counter_metrics(counters: dict[str, int], session_counters: dict[str, int] | None) -> dict[str, float]:
    """Cumulative request counters (retries of refused requests, groups given up) and, with the session
    endpoint, its own counters."""
    return {"rollout/requests_retried": float(counters.get("retried", 0)),
            "rollout/version_not_ready": float(counters.get("version_not_ready", 0)),
            "rollout/lost_groups": float(counters.get("lost_groups", 0)),
            **({f"rollout/sessions/{name}": float(n) for name, n in session_counters.items()}
               if session_counters is not None else {})}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0
