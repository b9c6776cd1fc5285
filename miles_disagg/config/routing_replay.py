"""MoE routing replay: which runs may use it, and when engines return routed experts.

``--use-rollout-routing-replay`` (miles' meaning): every engine call returns the experts each
token was routed to, the samples carry them and the trainer replays them in forward and backward.
``--use-routing-replay``: the trainer's recompute and backward passes route as its forward did.
Both need a mixture-of-experts checkpoint; on a dense one each is refused (exit 2).

When routing is requested (one rule, used by the engine launch and by the rollout's requests):

* with ``--use-rollout-routing-replay``: always (managed SGLang engines get
  ``--enable-return-routed-experts``; attached engines and service replicas must have been
  started with it: a call they answer without routing stops the run);
* without it, for a MoE model served by managed built-in engines: always too, so the trainer
  can log ``train/routing_agreement`` (capturing costs the built-in engine nothing measurable);
* otherwise not (SGLang's capture is a GPU-side copy per layer: only when replay needs it).

Pure apart from reading ``config.json``.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles_disagg.config.components import RunConfig
from miles_disagg.config.hf_config import QWEN3_MOE_DEFAULTS
from miles_disagg.types import ConfigError

REPLAY_FLAGS = (("--use-rollout-routing-replay", "use_rollout_routing_replay"),
                ("--use-routing-replay", "use_routing_replay"))

def moe_routing_shape(hf_dir: str | Path | None) -> tuple[int, int] | None:
    """``(num_hidden_layers, num_experts_per_tok)`` of a MoE checkpoint; None for a dense one,
    or when there is no readable config.json yet."""
    if not hf_dir:
        return None
    path = Path(hf_dir) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict):
        return None
    raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    values = {**(QWEN3_MOE_DEFAULTS if raw.get("model_type") == "qwen3_moe" else {}), **raw}
    experts = values.get("num_experts") or values.get("num_local_experts") or values.get("n_routed_experts") or 0
    if not isinstance(experts, int) or experts <= 0:
        return None
    layers, top_k = values.get("num_hidden_layers"), values.get("num_experts_per_tok")
    if not (isinstance(layers, int) and isinstance(top_k, int) and layers > 0 and top_k > 0):
        raise ConfigError(f"{path}: a MoE config ({experts} experts) needs integer num_hidden_layers and "
                          f"num_experts_per_tok, got {layers!r} and {top_k!r}", ("--hf-checkpoint",))
    return layers, top_k


def check_routing_replay(config: RunConfig) -> None:
    """``ConfigError`` (exit 2) when a routing-replay flag is given for a dense model."""
    given = [flag for flag, name in REPLAY_FLAGS if getattr(config.train, name)]
    if not given:
        return
    path = config.train.hf_checkpoint
    if path is None:
        raise ConfigError(f"{given[0]} replays MoE routing: give --hf-checkpoint (a MoE model)",
                          (given[0], "--hf-checkpoint"))
    if not (Path(path) / "config.json").is_file():
        if config.train.hf_checkpoint_init != "none" and not Path(path).exists():
            return  # made at start-up; the tiny checkpoint maker decides its experts
        raise ConfigError(f"--hf-checkpoint {str(path)!r} has no config.json to tell whether it is a MoE model "
                          f"({given[0]} needs one)", ("--hf-checkpoint", given[0]))
    if moe_routing_shape(path) is None:
        raise ConfigError(f"{given[0]} replays mixture-of-experts routing, but --hf-checkpoint {path} is a dense "
                          "model (its config.json has no experts): drop the flag", (given[0], "--hf-checkpoint"))


def engines_return_routing(*, moe: bool, replay: bool, backend: str | None) -> bool:
    """Whether engines are asked for routed experts (see the module docstring); ``backend``: the
    managed engines' backend (``builtin``/``sglang``), None for attached engines or a service."""
    return replay or (moe and backend == "builtin")


def rollout_routing_shape(config: RunConfig, backend: str | None) -> tuple[int, int] | None:
    """The routing rows the rollout asks for: ``(layers, top_k)``, or None when it asks for none."""
    shape = moe_routing_shape(config.train.hf_checkpoint)
    replay = config.train.use_rollout_routing_replay
    if shape is None and replay:
        raise ConfigError(f"--use-rollout-routing-replay: --hf-checkpoint {config.train.hf_checkpoint} is not a "
                          "mixture-of-experts model (no experts in its config.json)",
                          ("--use-rollout-routing-replay", "--hf-checkpoint"))
    if shape is None or not engines_return_routing(moe=True, replay=replay, backend=backend):
        return None
    return shape
