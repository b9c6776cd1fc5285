"""A prefix cache over token ids for the built-in engine, keyed by the weights that computed it.

A radix tree: each edge holds a run of token ids and the KV the model computed for them (per
layer ``(keys, values)``, each ``[kv_heads, tokens, head_dim]``), so the path from the root to a
node is one cached prefix and its KV is the concatenation of the edges' KV. A request whose
prompt starts with a cached prefix computes only the rest (:meth:`PrefixCache.match`); a
finished request leaves the KV of its prompt and output in the tree (:meth:`PrefixCache.insert`).

Contracts:

* **Versions.** The tree holds KV of one *key* only: the live weight version label together with
  the scheduler's weights epoch (bumped by every swap of live tensors, so an update that keeps its
  label still counts as other weights). A lookup or insert under another key never sees the old
  KV: an insert under a new key drops the tree first, a lookup under another key misses, and the
  scheduler drops the tree at every swap (:meth:`PrefixCache.drop`). Every node also records the
  key it was computed under and a match checks it, counting any offender in
  ``cross_version_tokens`` (the invariant's witness; it stays 0).
* **Namespaces.** Within one key, requests of different namespaces (SGLang's ``extra_key``, the
  field a client sends to keep cache entries apart, e.g. per adapter or per weight version) each
  have their own tree: a lookup sees only its own namespace's KV. Eviction spans them all.
* **Memory.** At most ``max_tokens`` tokens of KV are held; inserting past it evicts whole leaves,
  least recently used first (a lookup or insert touches every node on its path). ``max_tokens``
  0 turns the cache off.
* **Copies.** Edges own their tensors (cloned on insert and split) and a match returns a fresh
  concatenation, so the forward pass that extends a match never writes into the tree.
* **Threads.** Used by the scheduler thread only (between steps), like the KV batch.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Hashable

import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer ``(keys, values)`` of one sequence, each ``[kv_heads, tokens, head_dim]``."""


@dataclass(eq=False)
class RadixNode:
    """One edge of the tree: ``tokens`` and their KV, below ``parent``."""

    tokens: tuple[int, ...]
    kv: Layers
    key: Hashable
    parent: "RadixNode | None" = None
    children: dict[int, "RadixNode"] = field(default_factory=dict)
    last_used: int = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class PrefixCacheStats:
    """Counters since start (``/get_server_info`` shows them)."""

    lookup_tokens: int = 0
    """Prompt tokens of the requests that looked the cache up."""
    hit_tokens: int = 0
    """Of those, the tokens whose KV came from the cache (SGLang's ``cached_tokens``)."""
    inserted_tokens: int = 0
    evicted_tokens: int = 0
    num_drops: int = 0
    """Times the whole tree was dropped (a weight swap, a new version, ``/flush_cache``)."""
    cross_version_tokens: int = 0
    """Tokens a match found cached under another key than the lookup's (refused; must stay 0)."""

    def to_json(self, held_tokens: int, max_tokens: int) -> dict:
        ratio = self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0
        return {"max_tokens": max_tokens, "held_tokens": held_tokens, "hit_ratio": round(ratio, 6),
                **{name: getattr(self, name) for name in self.__dataclass_fields__}}


class PrefixCache:
    """See the module docstring."""

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache size must be >= 0 tokens, got {max_tokens}")
        self.max_tokens = max_tokens
        self.key: Hashable = None
        self.roots: dict[Hashable, RadixNode] = {}
        self.held_tokens = 0
        self.stats = PrefixCacheStats()
        self.clock = 0

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def to_json(self) -> dict:
        return self.stats.to_json(self.held_tokens, self.max_tokens)

    # ------------------------------------------------------------------ lookups

    def match(self, tokens: list[int], key: Hashable, limit: int,
              namespace: Hashable = None) -> tuple[int, Layers | None]:
        """The longest cached prefix of ``tokens[:limit]`` computed under ``key`` in ``namespace``: its
        length and its KV (per layer ``[1, kv_heads, length, head_dim]``, a fresh copy), or ``(0, None)``."""
        self.stats.lookup_tokens += len(tokens)
        root = self.roots.get(namespace)
        if not self.enabled or key != self.key or limit <= 0 or root is None:
            return 0, None
        pieces, matched = self._walk(root, tokens[:limit], key)
        if not matched:
            return 0, None
        self.stats.hit_tokens += matched
        layers = [(torch.cat([p[i][0] for p in pieces], dim=1).unsqueeze(0),
                   torch.cat([p[i][1] for p in pieces], dim=1).unsqueeze(0)) for i in range(len(pieces[0]))]
        return matched, layers

    def _walk(self, root: RadixNode, tokens: list[int], key: Hashable) -> tuple[list[Layers], int]:
        """The KV pieces along the path matching ``tokens`` (the last one cut to the match)."""
        node, pos, pieces = root, 0, []
        self.clock += 1
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            if child.key != key:  # cannot happen while drops keep the tree of one key; counted if it does
                self.stats.cross_version_tokens += len(child.tokens)
                break
            common = _common_length(child.tokens, tokens, pos)
            child.last_used = self.clock
            pieces.append(child.kv if common == len(child.tokens) else [(k[:, :common], v[:, :common])
                                                                        for k, v in child.kv])
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return pieces, pos

    # ------------------------------------------------------------------ inserts and eviction

    def insert(self, tokens: list[int], layers: Layers, key: Hashable, namespace: Hashable = None) -> int:
        """Cache ``tokens`` with their KV (per layer ``[kv_heads, len(tokens), head_dim]``) under
        ``key`` in ``namespace``; a new key drops what the trees held first. Returns the tokens newly
        cached."""
        if not self.enabled or not tokens:
            return 0
        if key != self.key:
            self.drop()
            self.key = key
        tokens = tokens[:self.max_tokens]
        node, pos = self.roots.setdefault(namespace, RadixNode((), [], key)), 0
        self.clock += 1
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, pos)
            if common < len(child.tokens):
                child = self._split(child, common)
            child.last_used = self.clock
            node, pos = child, pos + common
        added = len(tokens) - pos
        if added:
            leaf = RadixNode(tuple(tokens[pos:]), [(k[:, pos:len(tokens)].clone(), v[:, pos:len(tokens)].clone())
                                                   for k, v in layers], key, parent=node, last_used=self.clock)
            node.children[tokens[pos]] = leaf
            self.held_tokens += added
            self.stats.inserted_tokens += added
            self._evict(protect=leaf)
        return added

    def _split(self, child: RadixNode, at: int) -> RadixNode:
        """Cut ``child``'s edge after ``at`` tokens; return the new upper node."""
        parent = child.parent
        upper = RadixNode(child.tokens[:at], [(k[:, :at].clone(), v[:, :at].clone()) for k, v in child.kv],
                          child.key, parent=parent, last_used=child.last_used)
        child.tokens = child.tokens[at:]
        child.kv = [(k[:, at:].clone(), v[:, at:].clone()) for k, v in child.kv]
        child.parent = upper
        upper.children[child.tokens[0]] = child
        parent.children[upper.tokens[0]] = upper
        return upper

    def _evict(self, protect: RadixNode) -> None:
        """Drop least recently used leaves until at most ``max_tokens`` are held (``protect``, the
        leaf just inserted, goes last: an insert always keeps what it can)."""
        if self.held_tokens <= self.max_tokens:
            return
        heap = [(n.last_used, id(n), n) for n in self._leaves() if n is not protect]
        heapq.heapify(heap)
        while self.held_tokens > self.max_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = self._remove_leaf(leaf)
            if parent.parent is not None and parent.is_leaf and parent is not protect:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def _remove_leaf(self, leaf: RadixNode) -> RadixNode:
        parent = leaf.parent
        del parent.children[leaf.tokens[0]]
        self.held_tokens -= len(leaf.tokens)
        self.stats.evicted_tokens += len(leaf.tokens)
        return parent

    def _leaves(self) -> list[RadixNode]:
        leaves, stack = [], [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            if node.is_leaf:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def drop(self) -> None:
        """Forget everything (a weight swap, ``/flush_cache``, memory released)."""
        if self.held_tokens:
            self.stats.num_drops += 1
        self.roots = {}
        self.held_tokens = 0
        self.key = None

    def cached_prefix_length(self, tokens: list[int], key: Hashable, namespace: Hashable = None) -> int:
        """How many leading ``tokens`` are cached under ``key`` in ``namespace`` (tests; no stats)."""
        if key != self.key or namespace not in self.roots:
            return 0
        node, pos = self.roots[namespace], 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            common = _common_length(child.tokens, tokens, pos)
            pos += common
            if common < len(child.tokens):
                break
            node = child
        return pos


def _common_length(edge: tuple[int, ...], tokens: list[int], pos: int) -> int:
    """How many of ``edge``'s tokens equal ``tokens[pos:]``, from the start."""
    limit = min(len(edge), len(tokens) - pos)
    count = 0
    while count < limit and edge[count] == tokens[pos + count]:
        count += 1
    return count
