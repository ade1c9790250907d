"""Which token prefixes are cached, and where: in a KV slot, or exported to host memory.

Every sequence slot of the context holds the KV of a token list from position 0: a
lane's prompt-so-far, or an idle entry left behind by a finished job. `PrefixCache.lookup`
finds the longest prefix of a new job's tokens held anywhere, so the job starts from a
copy of it instead of a prefill. When a slot is needed, the least valuable idle entry
(unpinned before pinned, least recently used first) is exported to host memory
(`HostCache`, bounded in bytes) and imported again when a later job can use it; what
host memory cannot keep goes to the park (`park.py`), if there is one.
Pins (`Pin` on a session) keep matching entries in their slots until they expire.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .prefix_tree import PrefixTree, common_prefix


@dataclass
class CacheEntry:
    """An idle slot holding the KV of `tokens` (positions 0 .. len - 1)."""

    seq: int
    tokens: np.ndarray
    last_used: float = field(default_factory=time.monotonic)
    pinned_until_ms: int = 0

    def pinned(self, now_ms: int) -> bool:
        return self.pinned_until_ms > now_ms


@dataclass(frozen=True)
class Seed:
    """Where a new job's prefix comes from: `length` tokens of sequence `seq`.

    `take` means the job may own `seq` outright (an idle entry it extends), instead of
    copying it into a fresh slot.
    """

    seq: int
    length: int
    take: bool


@dataclass
class HostEntry:
    """An exported slot: its tokens and llama.cpp's state bytes."""

    tokens: np.ndarray
    state: bytes


class HostCache:
    """Exported prefixes in host memory, least recently used dropped first beyond `budget` bytes.

    `on_drop` receives what the budget pushes out (the park takes it), never an entry that a
    newer export extends."""

    def __init__(self, budget: int, on_drop: Callable[[np.ndarray, bytes], None] = lambda tokens, state: None) -> None:
        self.budget = budget
        self.on_drop = on_drop
        self.entries: OrderedDict[int, HostEntry] = OrderedDict()
        self.bytes = 0
        self._ids = 0
        self._tree: PrefixTree[int] = PrefixTree()

    def add(self, tokens: np.ndarray, state: bytes) -> None:
        if len(state) > self.budget:
            self.on_drop(tokens, state)
            return
        for key in self._tree.prefixes_of(tokens):
            self._drop(key)  # the new export extends it
        self._ids += 1
        self.entries[self._ids] = HostEntry(tokens, state)
        self._tree.add(self._ids, tokens)
        self.bytes += len(state)
        while self.bytes > self.budget:
            dropped = self.entries[next(iter(self.entries))]
            self._drop(next(iter(self.entries)))
            self.on_drop(dropped.tokens, dropped.state)

    def lookup(self, tokens: np.ndarray, limit: int) -> tuple[HostEntry, int] | None:
        """The entry sharing the longest prefix with `tokens` (at most `limit` of them)."""
        found = self._tree.longest(tokens, limit)
        if found is None:
            return None
        key, length = found
        self.entries.move_to_end(key)
        return self.entries[key], length

    def _drop(self, key: int) -> None:
        self.bytes -= len(self.entries.pop(key).state)
        self._tree.remove(key)

    def __len__(self) -> int:
        return len(self.entries)


class PrefixCache:
    """Idle KV entries by slot, the host tier behind them, and the pins that protect them."""

    def __init__(
        self, host_budget: int = 0, on_host_drop: Callable[[np.ndarray, bytes], None] = lambda tokens, state: None
    ) -> None:
        self.entries: dict[int, CacheEntry] = {}
        self.host = HostCache(host_budget, on_host_drop)
        self.pins: list[tuple[np.ndarray, int]] = []

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, seq: int, tokens: np.ndarray, now_ms: int) -> None:
        self.entries[seq] = CacheEntry(seq, tokens, pinned_until_ms=self.pinned_until(tokens, now_ms))

    def remove(self, seq: int) -> CacheEntry:
        return self.entries.pop(seq)

    def lookup(self, tokens: np.ndarray, running: dict[int, np.ndarray], now_ms: int) -> Seed | None:
        """The best slot to start `tokens` from: an idle entry or a running lane.

        At least one token is always left to prefill, since logits come from a decode.
        """
        limit = len(tokens) - 1
        best: Seed | None = None
        for seq, held in running.items():
            length = min(common_prefix(tokens, held), limit)
            if length > 0 and (best is None or length > best.length):
                best = Seed(seq, length, take=False)
        for entry in self.entries.values():
            shared = common_prefix(tokens, entry.tokens)
            length = min(shared, limit)
            if length <= 0 or (best is not None and length <= best.length):
                continue
            # a job that extends an entry's whole history can own it; others copy it
            extends = shared == len(entry.tokens) or shared >= limit
            best = Seed(entry.seq, length, take=extends and not entry.pinned(now_ms))
        return best

    def touch(self, seq: int) -> None:
        entry = self.entries.get(seq)
        if entry is not None:
            entry.last_used = time.monotonic()

    def victim(self, now_ms: int, spare: int | None = None) -> int | None:
        """The idle entry to evict next: least recently used, unpinned ones first; never `spare`."""
        candidates = [e for e in self.entries.values() if e.seq != spare]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (e.pinned(now_ms), e.last_used)).seq

    def pin(self, tokens: np.ndarray, until_ms: int) -> None:
        """Keep entries holding `tokens` (a session's history) in their slots until `until_ms`; 0 unpins."""
        self.pins = [(t, d) for t, d in self.pins if not np.array_equal(t, tokens)]
        if until_ms:
            self.pins.append((tokens, until_ms))
        for entry in self.entries.values():
            entry.pinned_until_ms = self.pinned_until(entry.tokens, 0)

    def pinned_until(self, tokens: np.ndarray, now_ms: int) -> int:
        """The latest pin deadline that covers `tokens`' prefix (0 when none does)."""
        deadline = 0
        for pinned, until in self.pins:
            if until > now_ms and len(pinned) and common_prefix(tokens, pinned) >= min(len(pinned), len(tokens)):
                deadline = max(deadline, until)
        return deadline

    def expire_pins(self, now_ms: int) -> None:
        self.pins = [(t, d) for t, d in self.pins if d > now_ms]
