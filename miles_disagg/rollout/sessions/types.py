"""A session's record and the rules over it. Pure: no I/O.

A session is a trajectory tree (:mod:`.tree`): one node per engine call, holding the exact token ids
the engine received and generated (:class:`Turn`) and the messages the call added, as the client sees
them (to match the history a client sends back). A turn's prompt must extend the ids of the node it
continues (:meth:`SessionState.check_prefix`): a mismatch is a :class:`PrefixMismatch`, the session is
broken with its reason and its samples are dropped, never re-tokenized. A finished session becomes one
training sample per branch (:func:`session_samples`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from miles_disagg.rollout.sessions.tree import Node, branch_samples, leaves
from miles_disagg.samples import Sample
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
    nodes: list[Node] = field(default_factory=list)
    """The trajectory tree's nodes in commit order (:mod:`.tree`)."""
    broken: str | None = None
    created_s: float = field(default_factory=time.monotonic)

    @property
    def turns(self) -> list[Turn]:
        """Every engine call of the session, in commit order (all branches)."""
        return [node.turn for node in self.nodes]

    @property
    def token_ids(self) -> list[int]:
        """The latest turn's prompt and output (the path a linear session holds)."""
        return self.nodes[-1].token_ids if self.nodes else []

    def check_usable(self) -> None:
        if self.broken is not None:
            raise SessionBroken(f"session {self.session_id} is broken: {self.broken}")
        if len(self.nodes) >= MAX_TURNS:
            raise InvalidInput(f"session {self.session_id} has {MAX_TURNS} turns, the most one session takes")

    def check_prefix(self, prompt_ids: list[int], parent: Node | None = None) -> None:
        """``PrefixMismatch`` unless ``parent``'s ids (the latest node's when not given) are a prefix of ``prompt_ids``."""
        stored = (parent or self.nodes[-1]).token_ids if (parent or self.nodes) else []
        if prompt_ids[:len(stored)] != stored:
            at = next((i for i, (a, b) in enumerate(zip(stored, prompt_ids)) if a != b), min(len(stored), len(prompt_ids)))
            raise PrefixMismatch(self.session_id, at, f"the next prompt has {len(prompt_ids)} tokens and does not "
                                                      f"start with the session's {len(stored)} stored tokens")

    def record(self, turn: Turn, assistant_message: dict, appended: list[dict], parent: Node | None = None,
               *, root: bool = False) -> Node:
        """A turn the engine answered, as a node under ``parent`` (default: the latest node; ``root``: a new root)."""
        if not root and parent is None and self.nodes:
            parent = self.nodes[-1]
        if parent is not None:
            self.check_prefix(list(turn.prompt_ids), parent)
        node = Node(len(self.nodes), None if parent is None else parent.seq, tuple(appended) + (assistant_message,),
                    turn)
        self.nodes.append(node)
        return node

    def to_json(self) -> dict[str, Any]:
        branches = leaves(self.nodes)
        return {"session_id": self.session_id, "num_turns": len(self.nodes), "num_tokens": len(self.token_ids),
                "num_branches": len(branches), "broken": self.broken, "metadata": self.metadata,
                "turns": [{"prompt_tokens": len(n.turn.prompt_ids), "completion_tokens": len(n.turn.output_ids),
                           "cached_tokens": n.turn.cached_tokens, "weight_version_start": n.turn.version_start,
                           "weight_version_end": n.turn.version_end, "finish_reason": n.turn.finish_reason,
                           "routed_worker": n.turn.worker, "node": n.seq, "parent": n.parent} for n in self.nodes]}


def token_drift(turns: list[Turn]) -> int:
    """How many turns' prompts do not start with the previous turn's prompt + output (0 when token-exact)."""
    return sum(1 for before, after in zip(turns, turns[1:])
               if after.prompt_ids[:len(before.prompt_ids) + len(before.output_ids)]
               != before.prompt_ids + before.output_ids)


def session_samples(state: SessionState, base: Sample) -> list[Sample]:
    """The finished session as training samples filled into copies of ``base`` (the prompt's sample): one per
    branch of its trajectory tree (:func:`~.tree.branch_samples`; a session whose harness never rewrote history
    has one). ``InvalidInput`` for a session without turns or one that broke."""
    if state.broken is not None:
        raise InvalidInput(f"session {state.session_id} broke ({state.broken}); its trajectory is not token-exact")
    if not state.nodes:
        raise InvalidInput(f"session {state.session_id} has no turns: the agent never called the model")
    return branch_samples(state.nodes, base, {"session_id": state.session_id, "num_session_turns": len(state.nodes)})
