"""Flags the whole-run tests share."""

ONE_ENGINE = ("--rollout-num-gpus", "1")
"""One built-in engine instead of the config's two, for runs whose checks are on the trainer's side
(learning, saves, resume, the policy's versions): each engine is a process of its own (about 3 CPU
seconds to start and stop), and one engine serves a tiny run as well as two."""
