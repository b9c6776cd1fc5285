"""``miles.utils.types``: miles' ``Sample`` is this project's (miles' field names are aliases on it,
``Sample.Status`` holds miles' statuses, and a sample takes free attributes as miles' does)."""

from __future__ import annotations

from miles_disagg.samples import Sample

RolloutBatch = dict
"""miles' training batch type: a dict of per-sample lists (``loss_masks``, ``log_probs`` ...); see
``miles_disagg.trainer.objective.miles_batch``."""

__all__ = ["Sample", "RolloutBatch"]
