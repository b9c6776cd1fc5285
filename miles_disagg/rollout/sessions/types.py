"""A session's record and the rules over it. Pure: no I/O.

A session holds the exact token ids of its conversation so far (every turn's prompt as the engine
received it, then what the engine generated), the messages as the client sees them (to match the
history a client sends back) and one :class:`Turn` per engine call. After every turn the stored ids
must be a prefix of the next prompt (:meth:`SessionState.check_prefix`): a mismatch is a
:class:`PrefixMismatch`, the session is broken with its reason and its sample is dropped, never
re-tokenized. A finished session becomes one training sample (:func:`session_sample`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from miles_disagg.samples import Sample, SampleStatus
from miles_disagg.types import InvalidInput, MilesDisaggError

MAX_SESSIONS = 10_000
MAX_TURNS = 256


class SessionNotFound(InvalidInput):
    """No live session has this id (never created, deleted, or expired)."""


class SessionBroken(InvalidInput):
    """The session failed an earlier check (its reason is in the message); it takes no more turns."""


class PrefixMismatch(MilesDisaggError):
    """The stored token ids are not a prefix of the next prompt (or the engine did not get the prompt
    it was sent): the trajectory would not be token-exact. Counted; the session's sample is dropped."""

    def __init__(self, session_id: str, at: int, detail: str):
        self.session_id, self.at = session_id, at
        super().__init__(f"session {session_id}: token drift at position {at}: {detail}")


@dataclass(frozen=True)
class Turn:
    """One engine call of a session: the prompt it got and what it generated, under which versions."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    output_logprobs: tuple[float, ...]
    version_start: int
    version_end: int
    finish_reason: str
    cached_tokens: int = 0
    worker: str | None = None


@dataclass
class SessionState:
    """One session (see the module docstring); mutated only by the service that owns it."""

    session_id: str
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    broken: str | None = None
    created_s: float = field(default_factory=time.monotonic)

    def check_usable(self) -> None:
        if self.broken is not None:
            raise SessionBroken(f"session {self.session_id} is broken: {self.broken}")
        if len(self.turns) >= MAX_TURNS:
            raise InvalidInput(f"session {self.session_id} has {MAX_TURNS} turns, the most one session takes")

    def check_prefix(self, prompt_ids: list[int]) -> None:
        """``PrefixMismatch`` unless the stored ids are a prefix of ``prompt_ids``."""
        stored = self.token_ids
        if prompt_ids[:len(stored)] != stored:
            at = next((i for i, (a, b) in enumerate(zip(stored, prompt_ids)) if a != b), min(len(stored), len(prompt_ids)))
            raise PrefixMismatch(self.session_id, at, f"the next prompt has {len(prompt_ids)} tokens and does not "
                                                      f"start with the session's {len(stored)} stored tokens")

    def record(self, turn: Turn, assistant_message: dict, appended: list[dict]) -> None:
        """A turn the engine answered: its prompt and output become the stored ids."""
        self.check_prefix(list(turn.prompt_ids))
        self.messages.extend(appended)
        self.messages.append(assistant_message)
        self.token_ids = list(turn.prompt_ids) + list(turn.output_ids)
        self.turns.append(turn)

    def to_json(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "num_turns": len(self.turns), "num_tokens": len(self.token_ids),
                "num_messages": len(self.messages), "broken": self.broken, "metadata": self.metadata,
                "turns": [{"prompt_tokens": len(t.prompt_ids), "completion_tokens": len(t.output_ids),
                           "cached_tokens": t.cached_tokens, "weight_version_start": t.version_start,
                           "weight_version_end": t.version_end, "finish_reason": t.finish_reason,
                           "routed_worker": t.worker} for t in self.turns]}


def token_drift(turns: list[Turn]) -> int:
    """How many turns' prompts do not start with the previous turn's prompt + output (0 when token-exact)."""
    return sum(1 for before, after in zip(turns, turns[1:])
               if after.prompt_ids[:len(before.prompt_ids) + len(before.output_ids)]
               != before.prompt_ids + before.output_ids)


def session_sample(state: SessionState, base: Sample) -> Sample:
    """The finished session as one training sample, filled into ``base`` (the prompt's sample): the first
    turn's prompt is the prompt; then per turn the tokens appended since the previous turn (``loss_mask`` 0)
    and the engine's output (``loss_mask`` 1, its logprobs); each turn recorded as one engine call, so the
    sample's start version is its oldest turn's (the staleness rule) and its end the last turn's.
    ``InvalidInput`` for a session without turns or one that broke."""
    if state.broken is not None:
        raise InvalidInput(f"session {state.session_id} broke ({state.broken}); its trajectory is not token-exact")
    if not state.turns:
        raise InvalidInput(f"session {state.session_id} has no turns: the agent never called the model")
    first = state.turns[0]
    base.prompt_ids, base.response_ids, base.response_logprobs = list(first.prompt_ids), [], []
    base.loss_mask, base.call_versions = [], []
    held = len(first.prompt_ids)
    for turn in state.turns:
        base.append_response(list(turn.prompt_ids[held:]), trained=False)
        base.append_response(list(turn.output_ids), list(turn.output_logprobs), trained=True)
        base.record_engine_call(turn.version_start, turn.version_end)
        held = len(turn.prompt_ids) + len(turn.output_ids)
    last = state.turns[-1].finish_reason
    base.finish_reason = last
    base.status = (SampleStatus.TRUNCATED if last == "length" else SampleStatus.COMPLETED).value
    base.metadata["session"] = {"session_id": state.session_id, "num_turns": len(state.turns),
                                "turn_versions": [[t.version_start, t.version_end] for t in state.turns]}
    return base
