"""The end-of-run summary (stderr + ``summary.json``) and ``report.png`` from ``metrics.jsonl``
(with the ``updates`` stream's activation timings joined to the steps that published them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from miles_disagg.tracking import METRICS_FILENAME, UPDATES_STREAM, read_metrics

WINDOW = 5
PLOTS = (
    ("rollout/raw_reward", "reward"),
    ("rollout/staleness_max", "staleness (max)"),
    ("perf/update_weights_density", "update density"),
    ("perf/update_weights_pause_time", "pause (s)"),
    ("perf/update_weights_prepare_time", "prepare (s)"),
    ("train/ppo_kl", "ppo_kl"),
)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward of the first vs last ``WINDOW`` steps, staleness, update cost."""
    rewards = [r["rollout/raw_reward"] for r in records if r.get("rollout/raw_reward") is not None]
    updates = [r for r in records if "perf/update_weights_wire_bytes" in r]

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    return {
        "steps": len(records),
        "reward_first": mean(rewards[:WINDOW]),
        "reward_last": mean(rewards[-WINDOW:]),
        "staleness_max": max((r.get("rollout/staleness_max", 0) or 0 for r in records), default=0),
        "stale_groups_dropped": sum(r.get("rollout/stale_groups_dropped", 0) or 0 for r in records),
        "updates": len(updates),
        "update_density_mean": mean(r.get("perf/update_weights_density") for r in updates),
        "wire_bytes_mean": mean(r.get("perf/update_weights_wire_bytes") for r in updates),
        "total_bytes": updates[-1].get("perf/update_weights_total_bytes") if updates else None,
        "prepare_time_mean_s": mean(r.get("perf/update_weights_prepare_time") for r in updates),
        "pause_time_mean_s": mean(r.get("perf/update_weights_pause_time") for r in updates),
        "pause_time_max_s": max((r.get("perf/update_weights_pause_time", 0) or 0 for r in updates), default=None),
        "samples_per_s": mean(r.get("perf/samples_per_s") for r in records),
    }


def write_report(run_dir: str | Path) -> dict[str, Any]:
    run_dir = Path(run_dir)
    records = _read(run_dir / METRICS_FILENAME)
    records = join_updates(records, _read(run_dir / f"{UPDATES_STREAM}.jsonl"))
    summary = summarize(records)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if records:
        plot(records, run_dir / "report.png")
    print(format_summary(summary, run_dir), file=sys.stderr)
    return summary


def join_updates(records: list[dict[str, Any]], updates: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each step's record with the activation it published (``train_async``: logged later to
    the ``updates`` stream) merged in; the record's own values win."""
    by_step = {u["step"]: u for u in updates}
    return [{**by_step.get(r["step"], {}), **r} for r in records]


def _read(path: Path) -> list[dict[str, Any]]:
    return read_metrics(path) if path.exists() else []


def format_summary(s: dict[str, Any], run_dir: Path) -> str:
    def f(value, fmt="{:.3f}"):
        return "n/a" if value is None else fmt.format(value)

    lines = [
        f"== run summary ({run_dir}) ==",
        f"steps: {s['steps']}   reward first {WINDOW}: {f(s['reward_first'])}   last {WINDOW}: {f(s['reward_last'])}",
        f"staleness max: {s['staleness_max']:.0f}   stale groups dropped: {s['stale_groups_dropped']:.0f}",
        f"updates: {s['updates']}   density: {f(s['update_density_mean'])}   wire: "
        f"{f(s['wire_bytes_mean'] and s['wire_bytes_mean'] / 1024, '{:.1f}')} KiB of "
        f"{f(s['total_bytes'] and s['total_bytes'] / 1024, '{:.1f}')} KiB per update",
        f"prepare: {f(s['prepare_time_mean_s'] and s['prepare_time_mean_s'] * 1e3, '{:.1f}')} ms   pause: mean "
        f"{f(s['pause_time_mean_s'] and s['pause_time_mean_s'] * 1e3, '{:.1f}')} ms, max "
        f"{f(s['pause_time_max_s'] and s['pause_time_max_s'] * 1e3, '{:.1f}')} ms",
        f"throughput: {f(s['samples_per_s'], '{:.1f}')} samples/s   report: {run_dir / 'report.png'}",
    ]
    return "\n".join(lines)


def plot(records: list[dict[str, Any]], path: Path) -> None:
    # a Figure on the Agg canvas directly: pyplot's import and tight_layout cost about a CPU-second
    # more per run and add nothing to one PNG
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 6))
    FigureCanvasAgg(fig)
    for ax, (key, title) in zip(fig.subplots(2, 3).flat, PLOTS):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), marker=".")
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.08, top=0.95, wspace=0.28, hspace=0.4)
    fig.savefig(path, dpi=80)
