"""miles' CI gates (``--ci-test``) and ``--check-weight-update-equal``: checks that fail the run.

Each failure raises :class:`CIGateFailed` with one line naming the gate and the values it saw;
the entry point turns it into exit code 1. Gates:

* first optimizer step of each rollout: ``ppo_kl`` and ``pg_clipfrac`` must be 0 (the trainer
  recomputes the behaviour logprobs with the same weights, so the ratio is exactly 1);
* after each weight update, every engine reports the trainer's version;
* ``--check-weight-update-equal`` (on with ``--ci-test``): after each update, each engine's
  per-tensor checksums equal the checksums of what the trainer published (disk-delta: the
  publisher's final state; broadcast: the trainer's exported tensors).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_disagg.config.components import RunConfig
from miles_disagg.types import FailRun

if TYPE_CHECKING:
    from miles_disagg.loop.job import Job

FIRST_STEP_KL_MAX = 1e-8
"""miles' bound on the first step's ppo_kl."""

FIRST_STEP_KL_KEYS = ("train/ppo_kl_first_step",)
FIRST_STEP_CLIPFRAC_KEYS = ("train/pg_clipfrac_first_step",)


class CIGateFailed(FailRun):
    """A ``--ci-test`` / ``--check-weight-update-equal`` gate failed; the message names it and its values."""


def check_step(record: dict[str, Any], config: RunConfig) -> None:
    """The per-step gates of ``--ci-test`` on one logged step record."""
    if not config.ci.ci_test:
        return
    step = record.get("step")
    if not config.ci.ci_disable_kl_checker:
        kl = _first(record, FIRST_STEP_KL_KEYS)
        if kl is not None and not abs(kl[1]) < FIRST_STEP_KL_MAX:
            raise CIGateFailed(f"--ci-test gate first-step ppo_kl: step {step} {kl[0]} = {kl[1]!r}, must be "
                               f"< {FIRST_STEP_KL_MAX:g} (the first optimizer step is on-policy)")
        clipfrac = _first(record, FIRST_STEP_CLIPFRAC_KEYS)
        if clipfrac is not None and clipfrac[1] != 0:
            raise CIGateFailed(f"--ci-test gate first-step pg_clipfrac: step {step} {clipfrac[0]} = {clipfrac[1]!r}, "
                               "must be 0 (the first optimizer step is on-policy)")
    version, engines = record.get("weights/version"), record.get("weights/engine_versions")
    if version is not None and engines is not None:
        behind = [(i, v) for i, v in enumerate(engines) if str(v) != str(version)]
        if behind:
            raise CIGateFailed(f"--ci-test gate engine versions: step {step} published v{version} but engines report "
                               f"{', '.join(f'engine {i}: {v!r}' for i, v in behind)}")


def check_weights_equal(job: "Job", version: int) -> dict[str, float]:
    """``--check-weight-update-equal``: every live engine holds exactly what the trainer published."""
    algorithm = job.config.weights.update_weight_delta_checksum
    expected = job.trainer.weight_checksums(algorithm)
    reports = job.engines.weight_checksums(algorithm)
    for report in reports:
        where = f"--check-weight-update-equal: engine {report['url']} after v{version}"
        if "error" in report:
            raise CIGateFailed(f"{where}: it cannot report its weights ({report['error']})")
        if str(report["weight_version"]) != str(version):
            raise CIGateFailed(f"{where}: it reports version {report['weight_version']!r}")
        got = report["checksums"]
        missing = sorted(name for name in expected if name not in got)
        differ = sorted(name for name in expected if name in got and got[name] != expected[name])
        if missing or differ:
            raise CIGateFailed(f"{where}: {len(differ)} of {len(expected)} tensors differ from the trainer's "
                               f"({', '.join(differ[:3]) or '-'}), {len(missing)} missing ({', '.join(missing[:3]) or '-'})")
    return {"ci/weights_equal_engines": float(len(reports))}


def _first(record: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, float] | None:
    for key in keys:
        if record.get(key) is not None:
            return key, float(record[key])
    return None
