"""miles-disagg: disaggregated RL rollout with versioned, verified policy publication."""

from miles_disagg.startup import start_without_cyclic_gc

__version__ = "0.1.0"

start_without_cyclic_gc()  # before any process of ours imports torch or ray (startup.py says why)
