"""What a training call returns to the driver: plain values, no torch.

The trainer ranks send a :class:`TrainResult` back through Ray; unpickling it in the driver
imports this module, so it must stay free of torch (about 3 CPU-seconds per run otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field


class MetricMeans:
    """Running means of named metrics (per micro-batch or per optimizer step)."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, key: str, value: float) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + float(value)
        self._counts[key] = self._counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / self._counts[k] for k in self._sums}


FIRST_STEP_KEYS = ("train/ppo_kl", "train/pg_clipfrac")


@dataclass
class TrainResult:
    """One rollout's training metrics: each optimizer step's, in order, and the rollout's own.

    ``steps[k]``: ``train/loss``, ``train/pg_loss``, ``train/pg_clipfrac``, ``train/ppo_kl``,
    ``train/entropy``, ``train/kl_loss`` (with ``--use-kl-loss``), ``train/tis_weight_mean``
    (``--use-tis``), ``train/grad_norm``, ``train/lr`` of step k over the global batch.
    ``rollout``: values of the whole rollout (``train/train_rollout_logprob_abs_diff``).
    """

    steps: list[dict[str, float]] = field(default_factory=list)
    rollout: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, float]:
        """The per-rollout record: each metric's mean over the steps, the FIRST step's
        ``ppo_kl`` and ``pg_clipfrac`` (``train/ppo_kl_first_step``, ``train/pg_clipfrac_first_step``:
        0 for an on-policy update, miles' CI gates), and the rollout values."""
        means = MetricMeans()
        for step in self.steps:
            for key, value in step.items():
                means.add(key, value)
        summary = means.means()
        if self.steps:
            for key in FIRST_STEP_KEYS:
                if key in self.steps[0]:
                    summary[f"{key}_first_step"] = self.steps[0][key]
        summary.update(self.rollout)
        return summary
