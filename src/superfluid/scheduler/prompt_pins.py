"""Prefixes pinned by prompt-cache marks (Anthropic `cache_control`), within a budget of KV tokens.

A client that marks a breakpoint asks for the prompt up to it to stay cached for a while
(five minutes, or an hour with `ttl: "1h"`). Each marked prefix becomes a pin on the
prefix cache, which keeps the entries holding it in their slots. Pins from marks may hold
at most `--pin-budget-pct` of the KV pool: past it, the least recently marked prefix is
released first, so an agent that sends a new system prompt each turn cannot crowd out the
rest. A pin made through the session API is not counted here and never released by it.
"""

from __future__ import annotations

from collections import OrderedDict

from ..store.sessions import now_ms
from .scheduler import Scheduler

DEFAULT_TTL_MS = 5 * 60_000
TTLS_MS = {"5m": DEFAULT_TTL_MS, "1h": 60 * 60_000}


class PromptPins:
    """The prefixes pinned for one model's scheduler, least recently marked first."""

    def __init__(self, scheduler: Scheduler, budget_tokens: int) -> None:
        self.scheduler = scheduler
        self.budget_tokens = budget_tokens
        self._pins: OrderedDict[tuple[int, ...], int] = OrderedDict()  # prefix -> deadline (ms)

    @property
    def tokens(self) -> int:
        """KV tokens the live pins cover."""
        return sum(len(prefix) for prefix in self._pins)

    def pin(self, prefix: list[int], ttl_ms: int = DEFAULT_TTL_MS) -> bool:
        """Pin `prefix` for `ttl_ms` (a mark seen again renews it); False when it alone is over the budget."""
        now = now_ms()
        for stale in [p for p, deadline in self._pins.items() if deadline <= now]:
            del self._pins[stale]
        key = tuple(prefix)
        if not key or len(key) > self.budget_tokens:
            return False
        deadline = max(now + ttl_ms, self._pins.pop(key, 0))
        self._pins[key] = deadline
        released = []
        while self.tokens > self.budget_tokens:
            oldest, _ = self._pins.popitem(last=False)
            released.append(oldest)
        for oldest in released:
            self.scheduler.pin(list(oldest), 0)
        self.scheduler.pin(prefix, deadline)
        return True

    def __len__(self) -> int:
        return len(self._pins)
