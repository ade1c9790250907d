"""Which token prefixes the KV slots hold, and where.

Every sequence slot of the context holds the KV of a token list from position 0: a
lane's prompt-so-far, or an idle entry left behind by a finished job. `PrefixCache.lookup`
finds the longest prefix of a new job's tokens held anywhere, so the job starts from a
copy of it instead of a prefill. Idle entries are evicted least recently used first,
unpinned before pinned.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class CacheEntry:
    """An idle sequence holding the KV of `tokens` (positions 0 .. len - 1)."""

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


class PrefixCache:
    """Idle KV entries by sequence id, and the lookup that seeds new jobs from them."""

    def __init__(self) -> None:
        self.entries: dict[int, CacheEntry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, seq: int, tokens: np.ndarray, pinned_until_ms: int = 0) -> None:
        self.entries[seq] = CacheEntry(seq, tokens, pinned_until_ms=pinned_until_ms)

    def remove(self, seq: int) -> CacheEntry:
        return self.entries.pop(seq)

    def lookup(self, tokens: np.ndarray, running: dict[int, np.ndarray], now_ms: int) -> Seed | None:
        """The best source for `tokens`' prefix among idle entries and running sequences.

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

    def pin(self, tokens: np.ndarray, until_ms: int) -> bool:
        """Pin every entry that `tokens` extends (or that extends `tokens`)."""
        found = False
        for entry in self.entries.values():
            shared = common_prefix(tokens, entry.tokens)
            if shared == min(len(tokens), len(entry.tokens)) and shared > 0:
                entry.pinned_until_ms = until_ms
                found = True
        return found
