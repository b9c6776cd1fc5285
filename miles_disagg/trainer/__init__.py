"""The policy trainer: placement, trainer group (Ray actors), backends, losses."""
