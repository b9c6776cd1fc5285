"""Fully async RL training: generation stays in flight while the trainer consumes completed groups.

    python train_async.py --config configs/tiny_cpu.yaml [--flag value ...]

The logic lives in ``miles_disagg``; this file only hands over the command line.
"""

import sys

from miles_disagg.launcher import main

if __name__ == "__main__":
    sys.exit(main("train_async"))
