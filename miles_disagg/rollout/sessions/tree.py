"""miles' trajectory tree: a session's turns as an append-only forest, one training sample per leaf. Pure.

Each engine call of a session is a :class:`Node`: the messages it added (those appended by the
request beyond its parent's path, then the assistant's answer), its :class:`~.types.Turn`, and its
parent. A request attaches to the deepest node whose whole path of messages is a prefix of the
request's messages under the session's matcher (:mod:`.matchers`); equally deep matches go to the
latest node. What the request carries beyond that path is appended there: a harness that continues
the conversation extends the path, one that rewrites or retries history starts a branch at the node
where its history still matches, or a new root where nothing matches. Existing branches are never
changed or deleted.

A finished session becomes one sample per leaf (:func:`branch_samples`), each the exact tokens of its
path: the root's prompt, then per node the tokens appended since the parent (``loss_mask`` 0) and the
engine's output with its logprobs. A completion shared by several leaves is trained once (miles'
exactly-once rule): its loss mask is 1 only in the earliest leaf that holds it, 0 (logprobs kept) in
the others. Each path turn is recorded as one engine call, so a branch's start version is its oldest
turn's (the staleness rule) and its end version its last turn's.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from miles_disagg.rollout.sessions.matchers import Matcher
from miles_disagg.samples import Sample, SampleStatus


@dataclass(frozen=True)
class Node:
    """One engine call of the session, attached to ``parent`` (a node's ``seq``; None: a root)."""

    seq: int
    parent: int | None
    delta: tuple[dict, ...]
    """The messages this call added to its parent's path: the appended ones, then the assistant's answer."""
    turn: Any
    """The call's :class:`~miles_disagg.rollout.sessions.types.Turn`."""

    @property
    def token_ids(self) -> list[int]:
        return list(self.turn.prompt_ids) + list(self.turn.output_ids)


@dataclass(frozen=True)
class AttachPoint:
    """Where a request continues the tree: ``node`` (None: a new root) and how many messages its path matched."""

    node: Node | None
    matched: int


def path(nodes: list[Node], node: Node) -> list[Node]:
    """Root to ``node``."""
    out = [node]
    while out[-1].parent is not None:
        out.append(nodes[out[-1].parent])
    return out[::-1]


def path_messages(nodes: list[Node], node: Node | None) -> list[dict]:
    return [] if node is None else [m for n in path(nodes, node) for m in n.delta]


def leaves(nodes: list[Node]) -> list[Node]:
    parents = {n.parent for n in nodes}
    return [n for n in nodes if n.seq not in parents]


def find_attach(nodes: list[Node], messages: list[dict], matches: Matcher) -> AttachPoint:
    """The deepest node whose whole path matches the start of ``messages`` (ties: the latest)."""
    children: dict[int | None, list[Node]] = {}
    for node in nodes:
        children.setdefault(node.parent, []).append(node)
    best, best_matched = None, 0
    stack = [(root, 0) for root in children.get(None, [])]
    while stack:
        node, offset = stack.pop()
        end = offset + len(node.delta)
        if end > len(messages) or not all(matches(m, messages[offset + i]) for i, m in enumerate(node.delta)):
            continue
        if end > best_matched or (end == best_matched and best is not None and node.seq > best.seq):
            best, best_matched = node, end
        stack.extend((child, end) for child in children.get(node.seq, []))
    return AttachPoint(best, best_matched)


def owners(nodes: list[Node]) -> dict[int, int]:
    """Each node's owning leaf: the earliest leaf (by ``seq``) whose path holds it."""
    owner: dict[int, int] = {}
    for leaf in leaves(nodes):
        for node in path(nodes, leaf):
            owner.setdefault(node.seq, leaf.seq)
    return owner


def branch_sample(nodes: list[Node], leaf: Node, owner: dict[int, int], base: Sample) -> Sample:
    """The branch ending at ``leaf`` as one sample filled into ``base`` (see the module docstring)."""
    route = path(nodes, leaf)
    base.prompt_ids, base.response_ids, base.response_logprobs = list(route[0].turn.prompt_ids), [], []
    base.loss_mask, base.call_versions = [], []
    held = len(route[0].turn.prompt_ids)
    for node in route:
        turn = node.turn
        base.append_response(list(turn.prompt_ids[held:]), trained=False)
        base.append_response(list(turn.output_ids), list(turn.output_logprobs), trained=True)
        if owner[node.seq] != leaf.seq:  # a completion an earlier leaf trains on: its tokens, no gradient here
            base.loss_mask[len(base.loss_mask) - len(turn.output_ids):] = [0] * len(turn.output_ids)
        base.record_engine_call(turn.version_start, turn.version_end)
        held = len(turn.prompt_ids) + len(turn.output_ids)
    base.finish_reason = leaf.turn.finish_reason
    base.status = (SampleStatus.TRUNCATED if leaf.turn.finish_reason == "length" else SampleStatus.COMPLETED).value
    return base


def branch_samples(nodes: list[Node], base: Sample, session_meta: dict[str, Any]) -> list[Sample]:
    """One sample per leaf, in the leaves' commit order; each a copy of ``base`` (the prompt's sample)
    with ``metadata["session"]``: ``session_meta``, its ``branch`` (leaf seq, path seqs), the number of
    branches and its turns' versions."""
    owner, ends = owners(nodes), leaves(nodes)
    out = []
    for index, leaf in enumerate(ends):
        sample = base if index == len(ends) - 1 else copy.deepcopy(base)
        branch_sample(nodes, leaf, owner, sample)
        route = path(nodes, leaf)
        sample.metadata["session"] = {**session_meta, "num_turns": len(route), "num_branches": len(ends),
                                      "branch": {"leaf": leaf.seq, "path": [n.seq for n in route]},
                                      "turn_versions": [[n.turn.version_start, n.turn.version_end] for n in route]}
        out.append(sample)
    return out
