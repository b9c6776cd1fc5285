"""The end-of-run summary (stderr + ``summary.json``) and ``report.png`` from ``metrics.jsonl``
(with the ``updates`` stream's activation timings joined to the steps that published them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from miles_disagg.loop.run_files import (CONFIG_FILENAME, ENGINE_EVENTS_FILENAME, EVENTS_STREAM, REPORT_FILENAME,
                                         SUMMARY_FILENAME)
from miles_disagg.tracking import METRICS_FILENAME, UPDATES_STREAM, read_metrics

WINDOW = 5
MS = 1e3
# (metric, panel title, y-axis label, scale): every panel's x axis is the rollout step
PLOTS = (
    ("rollout/raw_reward", "reward (mean over samples)", "reward", 1.0),
    ("rollout/staleness_max", "staleness (max)", "versions behind", 1.0),
    ("rollout/stale_groups_dropped", "stale groups dropped", "groups per step", 1.0),
    ("perf/update_weights_density", "update density", "fraction of bytes changed", 1.0),
    ("perf/update_weights_pause_time", "activation pause", "ms", MS),
    ("perf/update_weights_prepare_time", "prepare (pull + stage)", "ms", MS),
    ("train/ppo_kl", "ppo_kl", "nats per token", 1.0),
    ("perf/samples_per_s", "throughput", "samples / s", 1.0),
)
COLOCATE_PLOTS = {  # a colocated run has no publication or pause: its handoff instead
    "perf/update_weights_pause_time": ("perf/colocate_engine_release_time", "engines release memory", "ms", MS),
    "perf/update_weights_prepare_time": ("perf/update_weights_time", "weights to engines (handoff)", "ms", MS),
}
COLOCATE_KEY = "perf/colocate_offloaded_bytes"


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Reward of the first vs last steps (:func:`reward_window_steps`), staleness, update cost; counts
    (steps, staleness, groups dropped, updates, bytes) as integers."""
    rewards = [r["rollout/raw_reward"] for r in records if r.get("rollout/raw_reward") is not None]
    updates = [r for r in records if "perf/update_weights_wire_bytes" in r]

    def mean(values):
        values = [v for v in values if v is not None]
        return sum(values) / len(values) if values else None

    window = reward_window_steps(len(rewards))
    return {
        "steps": len(records),
        "reward_first": mean(rewards[:window]) if window else None,
        "reward_last": mean(rewards[-window:]) if window else None,
        "reward_window_steps": window,
        "reward_mean": mean(rewards),
        "staleness_max": _count(max((r.get("rollout/staleness_max", 0) or 0 for r in records), default=0)),
        "stale_groups_dropped": _count(sum(r.get("rollout/stale_groups_dropped", 0) or 0 for r in records)),
        "updates": len(updates),
        "update_density_mean": mean(r.get("perf/update_weights_density") for r in updates),
        "wire_bytes_mean": mean(r.get("perf/update_weights_wire_bytes") for r in updates),
        "total_bytes": _count(updates[-1].get("perf/update_weights_total_bytes")) if updates else None,
        "prepare_time_mean_s": mean(r.get("perf/update_weights_prepare_time") for r in updates),
        "pause_time_mean_s": mean(r.get("perf/update_weights_pause_time") for r in updates),
        "pause_time_max_s": max((r.get("perf/update_weights_pause_time", 0) or 0 for r in updates), default=None),
        "samples_per_s": mean(r.get("perf/samples_per_s") for r in records),
        **_handoff(records, mean),
    }


def reward_window_steps(num_steps: int) -> int:
    """Steps in each of the first and last reward windows: ``WINDOW``, or for a run shorter than two
    windows half its steps, so the two never share a step; 0 for a single step (too short for two)."""
    return min(WINDOW, num_steps // 2)


def _count(value: Any) -> Any:
    """A count recorded as a float (metrics are floats) as the integer it is."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _handoff(records: list[dict[str, Any]], mean) -> dict[str, Any]:
    """A colocated run's handoff (``loop/colocate.py``): no pause or prepare, but these, per step."""
    steps = [r for r in records if COLOCATE_KEY in r]
    if not steps:
        return {}
    return {"colocate_release_time_mean_s": mean(r.get("perf/colocate_engine_release_time") for r in steps),
            "colocate_onload_time_mean_s": mean(r.get("perf/colocate_trainer_onload_time") for r in steps),
            "colocate_update_time_mean_s": mean(r.get("perf/update_weights_time") for r in steps),
            "colocate_offloaded_bytes_mean": mean(r.get(COLOCATE_KEY) for r in steps)}


def run_end(error: BaseException | None) -> dict[str, str]:
    """How a run ended, for ``summary.json``: ``ended`` (``completed``, ``interrupted`` or ``failed``)
    and ``end_reason`` (the signal, or the error's type and message: Ray's wrapper unwrapped)."""
    if error is None:
        return {"ended": "completed", "end_reason": "every step done"}
    if isinstance(error, KeyboardInterrupt):
        import signal

        name = signal.Signals(getattr(error, "signum", int(signal.SIGINT))).name
        return {"ended": "interrupted", "end_reason": f"interrupted ({name})"}
    cause = getattr(error, "cause", None) or error
    return {"ended": "failed", "end_reason": f"{type(cause).__name__}: {cause}"[:4000]}


def write_end_report(run_dir: str | Path, error: BaseException | None) -> None:
    """The report of a run that ended (``error`` None: completed, with the summary printed); a run
    that failed or was interrupted writes ``summary.json`` quietly (its one line is the launcher's) and
    never raises here (the run's own error is the one to report)."""
    if error is None:
        write_report(run_dir, end=run_end(None))
        return
    import contextlib
    import io

    try:
        with contextlib.redirect_stderr(io.StringIO()):
            write_report(run_dir, end=run_end(error))
    except Exception as exc:  # noqa: BLE001 - the run is over either way
        print(f"no summary.json ({type(exc).__name__}: {exc}; see miles-disagg report {run_dir})", file=sys.stderr)


def write_report(run_dir: str | Path, end: dict[str, str] | None = None) -> dict[str, Any]:
    """``summary.json`` (with ``end``: how the run ended, :func:`run_end`), ``report.png`` where steps
    were recorded, and the summary on stderr. Without ``end``, the one ``summary.json`` says already is kept
    (``miles-disagg report`` rebuilding a finished run's summary)."""
    run_dir = Path(run_dir)
    end = end if end is not None else _previous_end(run_dir / SUMMARY_FILENAME)
    records = _read(run_dir / METRICS_FILENAME)
    records = join_updates(records, _read(run_dir / f"{UPDATES_STREAM}.jsonl"))
    summary = {**(end or {}), **summarize(records)}
    restarts = trainer_restarts(run_dir)
    if restarts:
        summary["trainer_restarts"] = restarts
    faults = engine_faults(run_dir)
    if faults:
        summary["engine_faults"] = faults
    (run_dir / SUMMARY_FILENAME).write_text(json.dumps(summary, indent=2) + "\n")
    if records:
        plot(records, run_dir / REPORT_FILENAME, title=report_title(run_dir))
    print(format_summary(summary, run_dir), file=sys.stderr)
    return summary


def _previous_end(path: Path) -> dict[str, str]:
    try:
        previous = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        return {}
    if not isinstance(previous, dict):
        return {}
    return {k: previous[k] for k in ("ended", "end_reason") if isinstance(previous.get(k), str)}


def trainer_restarts(run_dir: Path) -> list[dict[str, Any]]:
    """The run's trainer restarts (``events.jsonl``, ``loop/trainer_restart.py``), in order."""
    from miles_disagg.tracking import read_records

    return [{k: v for k, v in e.items() if k not in ("step", "wall_time", "event")}
            for e in read_records(run_dir / f"{EVENTS_STREAM}.jsonl") if e.get("event") == "trainer_restart"]


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
        f"steps: {s['steps']}   {_reward_line(s, f)}",
        f"staleness max: {s['staleness_max']:.0f}   stale groups dropped: {s['stale_groups_dropped']:.0f}",
        f"updates: {s['updates']}   density: {f(s['update_density_mean'])}   wire: "
        f"{f(s['wire_bytes_mean'] and s['wire_bytes_mean'] / 1024, '{:.1f}')} KiB of "
        f"{f(s['total_bytes'] and s['total_bytes'] / 1024, '{:.1f}')} KiB per update",
        _handoff_line(s, f) if "colocate_update_time_mean_s" in s else
        f"prepare: {f(s['prepare_time_mean_s'] and s['prepare_time_mean_s'] * 1e3, '{:.1f}')} ms   pause: mean "
        f"{f(s['pause_time_mean_s'] and s['pause_time_mean_s'] * 1e3, '{:.1f}')} ms, max "
        f"{f(s['pause_time_max_s'] and s['pause_time_max_s'] * 1e3, '{:.1f}')} ms",
        f"throughput: {f(s['samples_per_s'], '{:.1f}')} samples/s   report: {run_dir / 'report.png'}",
    ]
    for event in s.get("trainer_restarts", []):
        lines.append(f"trainer restart {event['restart']} of {event['max_restarts']} at step {event['failed_at_step']}: "
                     f"{event['failed']}; resumed from step {event['resumed_from_step']} at v{event['version']}")
    if s.get("engine_faults"):
        lines.append(faults_line(s["engine_faults"]))
    return "\n".join(lines)


def _reward_line(s: dict[str, Any], f) -> str:
    """``reward first N: x   last N: y`` over windows that share no step (N: the steps in each)."""
    window = s.get("reward_window_steps", WINDOW)
    if window:
        return f"reward first {window}: {f(s['reward_first'])}   last {window}: {f(s['reward_last'])}"
    if s.get("reward_mean") is None:
        return "reward: n/a"
    return f"reward: {f(s['reward_mean'])} (one step: too short for a first and a last window)"


def engine_faults(run_dir: Path) -> dict[str, Any] | None:
    """What the engines lost and got back (``engine_events.json``, written when the run stopped)."""
    path = run_dir / ENGINE_EVENTS_FILENAME
    events = json.loads(path.read_text()) if path.exists() else []
    if not events:
        return None

    def engines(kind: str) -> list[int]:
        return sorted({e["engine"] for e in events if e["event"] == kind and "engine" in e})

    return {"nodes_lost": sorted({e["node_id"] for e in events if e["event"] == "node_lost" and e.get("node_id")}),
            "engines_lost_with_node": engines("node_lost"), "engines_lost_with_actor": engines("actor_lost"),
            "went_down": sum(e["event"] == "down" for e in events),
            "replaced": sum(e["event"] == "replaced" for e in events),
            "restored": sum(e["event"] == "restored" for e in events),
            "failed_recoveries": sum(e["event"] in ("recovery_failed", "replace_failed") for e in events),
            "not_restarted": engines("lost"),
            "router_restarts": sum(e["event"] == "router_restarted" for e in events)}


def faults_line(faults: dict[str, Any]) -> str:
    """One line: engines lost (with their node, their actor, their process) and what came back."""
    lost = [f"{len(faults['nodes_lost'])} node(s) lost (engines {faults['engines_lost_with_node']})"
            if faults["nodes_lost"] else "", f"actors lost: engines {faults['engines_lost_with_actor']}"
            if faults["engines_lost_with_actor"] else "", f"{faults['went_down']} engine outage(s)"]
    back = f"{faults['replaced']} placed again, {faults['restored']} caught up and routed again"
    tail = [f"{faults['failed_recoveries']} failed recovery attempt(s)" if faults["failed_recoveries"] else "",
            f"not restarted: engines {faults['not_restarted']}" if faults["not_restarted"] else "",
            f"router restarted {faults['router_restarts']} time(s)" if faults.get("router_restarts") else ""]
    return "engines: " + ", ".join(p for p in lost if p) + "; " + "; ".join(p for p in [back, *tail] if p)


def _handoff_line(s: dict[str, Any], f) -> str:
    def ms(key):
        return f(s[key] and s[key] * 1e3, "{:.1f}")

    return (f"handoff (colocated, mean per step): engines release {ms('colocate_release_time_mean_s')} ms, trainer "
            f"onload {ms('colocate_onload_time_mean_s')} ms, weights to engines {ms('colocate_update_time_mean_s')} ms, "
            f"offloaded {f(s['colocate_offloaded_bytes_mean'] and s['colocate_offloaded_bytes_mean'] / 2**20, '{:.1f}')}"
            " MiB")


def report_title(run_dir: Path) -> str:
    """The run directory and the key settings of its command (from its ``config.json``)."""
    try:
        config = json.loads((run_dir / CONFIG_FILENAME).read_text())
        return f"{run_dir}\n{key_settings(config)}"
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return str(run_dir)


def key_settings(config: dict[str, Any]) -> str:
    """One line: entry, model, batch, staleness, transfer, engines, learning rate."""
    cluster, rollout, weights, train = (config.get(k, {}) for k in ("cluster", "rollout", "weights", "train"))
    engines = (cluster.get("rollout_num_gpus") or 0) // max(cluster.get("rollout_num_gpus_per_engine") or 1, 1)
    parts = [f"{config.get('entry', '?')}.py", f"model {Path(str(train.get('hf_checkpoint'))).name}",
             f"{rollout.get('rollout_batch_size')} prompts x {rollout.get('n_samples_per_prompt')} samples/step",
             f"staleness <= {rollout.get('max_weight_staleness')}" if rollout.get("max_weight_staleness") is not None
             else "staleness unbounded",
             "colocated" if cluster.get("colocate") else f"{weights.get('update_weight_transfer_mode')} updates",
             f"{engines} engine(s) ({rollout.get('rollout_backend')})", f"{train.get('train_backend')}",
             f"lr {train.get('lr')}"]
    return ", ".join(parts)


def plot(records: list[dict[str, Any]], path: Path, title: str | None = None) -> None:
    # a Figure on the Agg canvas directly: pyplot's import and tight_layout cost about a CPU-second
    # more per run and add nothing to one PNG
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(16, 7.5))
    FigureCanvasAgg(fig)
    colocated = any(COLOCATE_KEY in r for r in records)
    for ax, panel in zip(fig.subplots(2, 4).flat, PLOTS):
        key, name, unit, scale = COLOCATE_PLOTS.get(panel[0], panel) if colocated else panel
        points = [(r["step"], r[key] * scale) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            ax.plot(*zip(*points), marker=".")
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="gray")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("rollout step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(unit)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.08, top=0.86 if title else 0.94, wspace=0.32, hspace=0.42)
    fig.savefig(path, dpi=80)
