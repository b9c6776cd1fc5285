"""Pure sample types: one trajectory and the policy versions that generated it, a prompt's group of
samples, and the batch of groups the trainer takes.

No I/O and no heavy imports, like ``types.py`` (the versions and errors these build on).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from miles_disagg.types import BASE_VERSION, InvalidInput


class SampleStatus(str, Enum):
    """miles' ``Sample.Status`` values; a member equals its string (``SampleStatus.COMPLETED == "completed"``)."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass
class Sample:
    """One trajectory and the policy versions that generated it (from the response).

    Field names are this project's; miles' names are aliases (``tokens``, ``response_length``,
    ``rollout_log_probs`` settable, ``weight_versions`` read-only) so hooks written against
    miles' ``Sample`` read and fill the same values; like miles', a sample takes free attributes.
    A multi-turn episode appends to ``response_ids`` turn by turn: tokens the policy generated
    (``loss_mask`` 1, their engine logprob) and tokens the environment inserted (``loss_mask`` 0,
    logprob 0.0 as a placeholder).
    """

    Status = SampleStatus  # miles spells statuses Sample.Status.COMPLETED

    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    reward: float | None = 0.0
    """None only while a sample is being generated (a generate function may set it; else the reward function does)."""
    weight_version_start: int = BASE_VERSION
    weight_version_end: int = BASE_VERSION
    finish_reason: str = "length"
    metadata: dict[str, Any] = field(default_factory=dict)
    advantage: float = 0.0  # set by the trainer's advantage estimator
    loss_mask: list[int] | None = None
    """One 0/1 per response token: 0 for tokens the policy did not generate (tool or environment
    output in a multi-turn episode), which get no gradient. None: every response token is trained."""
    status: str = "completed"
    """``completed``, ``truncated`` or ``aborted`` (miles' sample status)."""
    prompt: str = ""
    """The rendered prompt text (miles' ``prompt``)."""
    label: Any = None
    """The dataset label (miles' ``label``)."""
    response: str = ""
    """The response text: every turn, environment text included (miles' ``response``)."""
    call_versions: list[list[int]] = field(default_factory=list)
    """``[start, end]`` served versions of each engine call that generated part of this sample, in
    order; ``weight_version_start`` is the first call's start, ``weight_version_end`` the last call's end."""
    rollout_routed_experts: Any = None
    """MoE routing replay (miles' field name): the experts the engines routed each token to, a numpy
    int32 array ``[len(prompt_ids) + len(response_ids) - 1, num_hidden_layers, num_experts_per_tok]``;
    row ``p`` is the routing of the token at position ``p`` of prompt + response (the last token never
    ran through the model, as in SGLang's ``meta_info["routed_experts"]``); layers without experts
    (dense MLP) hold -1. In a multi-turn sample row ``p`` comes from the engine call that first ran
    position ``p`` through the model, so each token replays the routing of the version that served it.
    None unless ``--use-rollout-routing-replay``."""
    teacher_logprobs: list[float] | None = None
    """On-policy distillation (``--use-opd``): the teacher's logprob of each response token given the
    prompt and the response before it (miles' ``teacher_log_probs``); None: not scored by a teacher."""
    teacher_version: str | None = None
    """The ``weight_version`` the teacher reported for the call that scored ``teacher_logprobs``."""
    opd_reverse_kl: list[float] | None = None
    """Top-k on-policy distillation (``--opd-log-prob-top-k``): each response token's reverse KL over its
    top-k token set, computed at rollout (miles' ``opd_reverse_kl``); the trainer takes it in place of
    ``student - teacher_logprobs``. None: sampled-token OPD (or none)."""

    def trained_mask(self) -> list[int]:
        """The loss mask, all ones when none was given."""
        return list(self.loss_mask) if self.loss_mask is not None else [1] * len(self.response_ids)

    @property
    def mixed_version(self) -> bool:
        return self.weight_version_start != self.weight_version_end

    # miles' names (miles' hooks set tokens, response_length and rollout_log_probs)
    @property
    def tokens(self) -> list[int]:
        """Prompt and response token ids (miles' ``tokens``)."""
        return list(self.prompt_ids) + list(self.response_ids)

    @tokens.setter
    def tokens(self, value: list[int]) -> None:
        """miles' hooks set ``tokens`` (prompt + response) and then ``response_length``: the split
        stays at the current prompt length until ``response_length`` moves it."""
        value = list(value)
        cut = min(len(self.prompt_ids), len(value))
        self.prompt_ids, self.response_ids = value[:cut], value[cut:]

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @response_length.setter
    def response_length(self, value: int) -> None:
        """The last ``value`` of ``tokens`` are the response (miles' meaning)."""
        tokens = self.tokens
        if not isinstance(value, int) or not 0 <= value <= len(tokens):
            raise InvalidInput(f"response_length {value!r} must be an int in [0, {len(tokens)}] (len(tokens))")
        self.prompt_ids, self.response_ids = tokens[:len(tokens) - value], tokens[len(tokens) - value:]

    @property
    def rollout_log_probs(self) -> list[float]:
        return self.response_logprobs

    @rollout_log_probs.setter
    def rollout_log_probs(self, value: list[float] | None) -> None:
        self.response_logprobs = [] if value is None else [float(x) for x in value]

    @property
    def teacher_log_probs(self) -> list[float] | None:
        """miles' name of ``teacher_logprobs`` (a miles hook may set a tensor or a list)."""
        return self.teacher_logprobs

    @teacher_log_probs.setter
    def teacher_log_probs(self, value) -> None:
        self.teacher_logprobs = None if value is None else [float(x) for x in value]

    @property
    def weight_versions(self) -> list[str]:
        """The version that finished each engine call, as strings (miles' ``weight_versions``)."""
        calls = self.call_versions or [[self.weight_version_start, self.weight_version_end]]
        return [str(end) for _, end in calls]

    @property
    def effective_response_length(self) -> int:
        """Response tokens that are trained (``loss_mask`` 1)."""
        return sum(self.trained_mask())

    # building a sample turn by turn
    def append_response(self, token_ids: list[int], logprobs: list[float] | None = None, *, trained: bool) -> None:
        """Append ``token_ids`` to the response: ``trained=True`` for tokens the policy generated (their
        engine logprobs, one per token), ``trained=False`` for environment or tool tokens (no gradient;
        logprob 0.0 placeholders). The loss mask stays one entry per response token."""
        token_ids = list(token_ids)
        logprobs = [0.0] * len(token_ids) if logprobs is None else [float(x) for x in logprobs]
        if len(logprobs) != len(token_ids):
            raise InvalidInput(f"{len(token_ids)} tokens but {len(logprobs)} logprobs")
        if not trained and self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        if self.loss_mask is not None:
            self.loss_mask.extend([1 if trained else 0] * len(token_ids))
        self.response_ids.extend(token_ids)
        self.response_logprobs.extend(logprobs)

    def record_engine_call(self, start: int, end: int) -> None:
        """One engine call served by versions ``start``..``end``: the sample's start is its first call's."""
        if not self.call_versions:
            self.weight_version_start = start
        self.call_versions.append([start, end])
        self.weight_version_end = end

    def check_consistent(self) -> None:
        """``InvalidInput`` unless the per-token fields line up (one logprob, one mask entry and any
        teacher logprob per response token) and the start/end versions are the first and last calls' versions."""
        n = len(self.response_ids)
        if len(self.response_logprobs) != n:
            raise InvalidInput(f"{n} response tokens but {len(self.response_logprobs)} rollout logprobs")
        if self.teacher_logprobs is not None and len(self.teacher_logprobs) != n:
            raise InvalidInput(f"{n} response tokens but {len(self.teacher_logprobs)} teacher logprobs")
        if self.opd_reverse_kl is not None and len(self.opd_reverse_kl) != n:
            raise InvalidInput(f"{n} response tokens but {len(self.opd_reverse_kl)} opd_reverse_kl terms")
        if self.loss_mask is not None and (len(self.loss_mask) != n or set(self.loss_mask) - {0, 1}):
            raise InvalidInput(f"loss_mask must hold one 0/1 per response token ({n}), got {self.loss_mask!r}")
        if self.call_versions and [self.weight_version_start, self.weight_version_end] != \
                [self.call_versions[0][0], self.call_versions[-1][1]]:
            raise InvalidInput(f"start/end versions {self.weight_version_start}/{self.weight_version_end} are not "
                               f"those of the first and last engine calls {self.call_versions}")


@dataclass
class Group:
    """The ``n_samples_per_prompt`` samples of one prompt (the unit GRPO normalizes over)."""

    prompt_index: int
    samples: list[Sample]

    @property
    def oldest_version(self) -> int:
        return min(s.weight_version_start for s in self.samples)

    def staleness(self, current_version: int) -> int:
        return current_version - self.oldest_version


@dataclass
class RolloutBatch:
    """Groups handed to the trainer, with the rollout's metrics for them (staleness, rewards, counters)."""

    groups: list[Group]
    metrics: dict[str, float] = field(default_factory=dict)
    advantages_given: bool = False
    """True when the rollout already set every sample's ``advantage`` (``--custom-reward-post-process-path``):
    the trainer's advantage estimator must not overwrite them."""

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self.groups)
