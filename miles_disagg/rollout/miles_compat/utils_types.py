"""``miles.utils.types``: miles' ``Sample`` is this project's (miles' field names are aliases on it,
``Sample.Status`` holds miles' statuses, and a sample takes free attributes as miles' does)."""

from __future__ import annotations

from miles_disagg.types import Sample

__all__ = ["Sample"]
