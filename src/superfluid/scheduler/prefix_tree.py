"""Token lists by key, found by the longest prefix they share with a query, without a scan.

The host tier and the park each hold hundreds to thousands of exported prefixes, and every
new lane asks both which one shares the most of its prompt. Comparing the prompt with each
in turn took 1.4 ms a lookup at 1,000 entries on the scheduler's thread, while the worker
waited for its next step, and grew with the park all daemon long. A radix tree walks the
prompt once instead: a node per point where held token lists part, its edge the run of
tokens they share from their parent, and every node knowing the keys that pass through it.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

import numpy as np

K = TypeVar("K", bound=Hashable)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


class _Node(Generic[K]):
    """A point where held token lists part. Most nodes are leaves, about one a key held, and a leaf's keys all
    end at it: so the keys that pass through a node are kept apart (`through`) only once it has had children,
    which leaves a leaf 64 bytes of keys where a set and a dict of one key took 440."""

    __slots__ = ("children", "edge", "ends", "through")

    def __init__(self, edge: np.ndarray) -> None:
        self.edge = edge  # the tokens from the parent's end to this node's
        self.children: dict[int, _Node[K]] = {}  # by the first token of the child's edge
        self.ends: list[K] = []  # the keys whose tokens end exactly here, oldest first
        # the keys whose tokens cover this node's edge, oldest first; None while those are `ends` (a leaf)
        self.through: dict[K, None] | None = None

    def keys(self) -> dict[K, None]:
        """The keys whose tokens cover this node's edge, oldest first (kept apart from now on)."""
        if self.through is None:
            self.through = dict.fromkeys(self.ends)
        return self.through

    def latest(self) -> K:
        """The key added last of those whose tokens cover this node's edge."""
        return self.ends[-1] if self.through is None else next(reversed(self.through))

    def held(self) -> bool:
        """True while a key's tokens cover this node's edge."""
        return bool(self.ends if self.through is None else self.through)


class PrefixTree(Generic[K]):
    """Keys of token arrays: `longest` finds the one sharing the longest prefix with a query, and
    `prefixes_of` those whose whole tokens begin a query, in time by the query's length, not by
    how many are held."""

    def __init__(self) -> None:
        self._root: _Node[K] = _Node(np.empty(0, dtype=np.int32))
        self._tokens: dict[K, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._tokens)

    def __contains__(self, key: object) -> bool:
        return key in self._tokens

    def add(self, key: K, tokens: np.ndarray) -> None:
        """Hold `tokens` under `key` (replacing what `key` held)."""
        if key in self._tokens:
            self.remove(key)
        self._tokens[key] = tokens
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:  # a new leaf, whose keys are its ends
                child = node.children[int(tokens[pos])] = _Node(tokens[pos:])
                node, pos = child, len(tokens)
                break
            shared = common_prefix(child.edge, tokens[pos : pos + len(child.edge)])
            if shared < len(child.edge):  # the tokens part from the edge inside it: a node where they part
                middle: _Node[K] = _Node(child.edge[:shared])
                middle.through = dict(child.keys())
                child.edge = child.edge[shared:]
                middle.children[int(child.edge[0])] = child
                node.children[int(tokens[pos])] = child = middle
            if child.through is not None or pos + shared < len(tokens):  # not a leaf the key ends at
                child.keys()[key] = None
            node, pos = child, pos + shared
        node.ends.append(key)  # `add` removed it first where it was held

    def remove(self, key: K) -> None:
        """Forget `key` (nothing when it is not held)."""
        tokens = self._tokens.pop(key, None)
        if tokens is None:
            return
        node, pos, path = self._root, 0, []
        while pos < len(tokens):
            child = node.children[int(tokens[pos])]
            if child.through is not None:
                del child.through[key]
            path.append((node, child))
            node, pos = child, pos + len(child.edge)
        node.ends.remove(key)
        for parent, child in reversed(path):
            if not child.held():  # no key passes here any more, nor below
                del parent.children[int(child.edge[0])]

    def longest(self, tokens: np.ndarray, limit: int) -> tuple[K, int] | None:
        """The key sharing the longest prefix with `tokens` (the most recently added of those that
        share as much) and that prefix's length, at most `limit`; None when none shares a token."""
        node, pos, deepest = self._root, 0, None
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            shared = common_prefix(child.edge, tokens[pos : pos + len(child.edge)])
            node, pos, deepest = child, pos + shared, child
            if shared < len(child.edge):
                break
        length = min(pos, limit)
        if deepest is None or length <= 0:
            return None
        return deepest.latest(), length

    def prefixes_of(self, tokens: np.ndarray) -> list[K]:
        """The keys whose whole tokens are a prefix of `tokens` (equal ones included)."""
        found = list(self._root.ends)
        node, pos = self._root, 0
        while pos < len(tokens):
            child = node.children.get(int(tokens[pos]))
            if child is None or common_prefix(child.edge, tokens[pos : pos + len(child.edge)]) < len(child.edge):
                break
            node, pos = child, pos + len(child.edge)
            found += node.ends
        return found
