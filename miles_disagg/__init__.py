"""miles-disagg: disaggregated RL rollout with versioned, verified policy publication."""

__version__ = "0.1.0"
