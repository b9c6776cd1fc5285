"""miles flags this launcher does not take: each is refused with one line saying why and what to use.

A miles launch script should never meet a bare "unrecognized arguments": every flag listed
here is registered with the parser (and recognized as a YAML key) only to be refused with
its reason. Flags whose *value* decides (``--megatron-to-hf-mode bridge``,
``--expert-model-parallel-size 4``) are accepted flags refused in ``validate.py`` with the
same wording (:func:`miles_refusal`).
"""

from __future__ import annotations

from dataclasses import dataclass

from miles_disagg.types import ConfigError


@dataclass(frozen=True)
class RefusedFlag:
    flag: str
    why: str
    instead: str

    @property
    def dest(self) -> str:
        return "refused__" + self.flag.removeprefix("--").replace("-", "_")

    @property
    def yaml_key(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


def miles_refusal(flag: str, why: str, instead: str) -> str:
    """The one-line refusal of a miles flag."""
    return f"{flag} is a miles flag that does not apply here: {why}; {instead}"


REFUSED_FLAGS: dict[str, RefusedFlag] = {f.flag: f for f in (
    RefusedFlag("--keep-old-actor",
                "it keeps a copy of the weights the engines serve to recompute the PPO ratio's denominator, but here a "
                "batch may mix samples of several policy versions (each sample records the version that served it)",
                "use --use-rollout-logprobs (the engines' own logprobs) or --use-tis"),
    RefusedFlag("--sglang-config",
                "it describes SGLang server groups (regular/prefill/decode) in YAML, and this launcher starts one kind "
                "of engine",
                "size the engines with --rollout-num-gpus and --rollout-num-gpus-per-engine and pass server options "
                "as --sglang-* flags"),
    RefusedFlag("--sglang-router-ip",
                "it points miles at an already running router, but this job starts its own version-aware router, "
                "which must know every engine's policy version",
                "drop it (--sglang-router-port sets the port of the job's router)"),
    RefusedFlag("--session-sample-picker-path",
                "it picks which branch samples of a session's trajectory tree survive, and here every branch is kept "
                "(miles' default picker), completions shared by branches trained once",
                "drop it (a harness's retries become branches of their own)"),
    RefusedFlag("--session-server-workers",
                "it starts several session server instances, and the run serves one session endpoint",
                "drop it"),
    RefusedFlag("--sglang-router-request-timeout-secs",
                "it sets sglang-router's per-request timeout, which the job's router does not take",
                "drop it"),
    *(RefusedFlag(flag,
                  "it configures Megatron / Transformer Engine FP8 training, and the trainer here trains in full "
                  "precision (low precision is a property of what the engines serve)",
                  "for FP8 rollout convert the checkpoint with miles-disagg convert-fp8, pass it as --hf-checkpoint and "
                  "the BF16 one as --train-hf-checkpoint (docs/low-precision.md)")
      for flag in ("--fp8-format", "--fp8-recipe", "--fp8-param-gather", "--fp8-amax-history-len",
                   "--fp8-amax-compute-algo")),
    RefusedFlag("--use-rollout-entropy",
                "it computes each token's entropy in the pass that recomputes the behaviour logprobs, for a custom "
                "loss mask over rollout data; that pass keeps only logprobs here",
                "compute the entropy from the logits in a --custom-loss-function-path (train/entropy is the "
                "training pass's, logged every step)"),
    RefusedFlag("--lora-type",
                "it picks Megatron's LoRA variant (canonical_lora splits the fused QKV), and adapters here are PEFT's "
                "on the HF projections, which are split already",
                "drop it (--target-modules q_proj,k_proj,v_proj names the projections one by one)"),
    RefusedFlag("--lora-sync-from-tensor",
                "it sends the adapter to colocated engines as tensors instead of files, and the adapter here travels "
                "as the version the trainer publishes",
                "drop it"),
    RefusedFlag("--lora-base-cpu-backup",
                "it keeps a CPU mirror of the base on colocated SGLang engines, and a LoRA run here never syncs the "
                "base again after version 0",
                "drop it"),
    RefusedFlag("--experts-shared-outer-loras",
                "it shapes adapters on MoE experts, and adapters here cover the attention (and dense MLP) "
                "projections, not the experts",
                "drop it (--target-modules attn on a Qwen3-MoE)"),
    RefusedFlag("--multi-lora-n-adapters",
                "it trains several adapters at once in slots (Tinker-style), and the trainer here trains one adapter",
                "run one job per adapter"),
    RefusedFlag("--check-lora-weight-equal",
                "it checks the colocated tensor sync of an adapter, and every adapter version here is checksummed "
                "per tensor and verified before it is served",
                "drop it"),
    RefusedFlag("--no-sglang-lora-use-virtual-experts",
                "it picks how SGLang serves adapters on MoE experts, and adapters here are not put on experts",
                "drop it"),
    RefusedFlag("--opd-teacher-adapters",
                "it picks, per sample, a LoRA adapter (lora_path) the one OPD teacher server was started with, and "
                "the teachers here are whole engines, one per --opd-teacher-urls name",
                "serve each teacher (its adapter merged) as its own engine and name them with --opd-teacher-urls "
                "NAME=URL"),
    RefusedFlag("--partial-rollout",
                "it recycles unfinished samples into the next rollout; here every group is generated whole",
                "drop it (--max-weight-staleness bounds how old a consumed sample may be)"),
)}


def unknown_flags_error(entry: str, tokens: list[str]) -> ConfigError:
    """A flag no component declares: it may be one of miles' (or Megatron's) many others. One line
    that says so, why it cannot apply, and what to do (never argparse's bare "unrecognized")."""
    flags = [t.split("=", 1)[0] for t in tokens if t.startswith("-")] or tokens
    return ConfigError(
        f"{', '.join(flags)}: not a flag of {entry}.py; if it is a miles or Megatron flag, nothing in this launcher "
        "implements it, so it cannot take effect here; remove it (docs/from-miles.md lists the miles "
        "flags that carry over and those refused with their reasons)", tuple(flags))


def check_refused(given: list[str], *, rollout_external: bool) -> None:
    """``ConfigError`` for the first refused flag in ``given`` (miles' own rejection first where
    miles has one: ``--sglang-config`` with ``--rollout-external``)."""
    if "--sglang-config" in given and rollout_external:
        raise ConfigError("--sglang-config cannot be combined with --rollout-external: attached engines' topology "
                          "comes from the engines themselves (miles refuses this too)",
                          ("--sglang-config", "--rollout-external"))
    for flag in given:
        refused = REFUSED_FLAGS[flag]
        raise ConfigError(miles_refusal(flag, refused.why, refused.instead), (flag,))
