"""The token bucket that meters `Complete` (fill-in-the-middle) requests.

A bucket holds up to `burst` tokens and refills at `rate` per second; it starts full.
A request takes one token; when there is none, the caller is told how long to wait.
The socket and /web/ws keep one bucket per connection, /web/rpc one per listener.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

COMPLETION_RATE = 10.0
COMPLETION_BURST = 20
MAX_WAIT_S = 24 * 3600.0


class TokenBucket:
    """Rate `rate` per second, up to `burst` at once; rate 0 means unmetered."""

    def __init__(
        self,
        rate: float = COMPLETION_RATE,
        burst: int = COMPLETION_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._last = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Take one token: 0.0 when allowed, else the seconds to wait before one is there."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(self.burst), self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens >= 1.0 - 1e-9:
                self._tokens -= 1.0
                return 0.0
            return min((1.0 - self._tokens) / self.rate, MAX_WAIT_S)

    def rested(self) -> bool:
        """True when the bucket has filled up again: forgetting it changes nothing."""
        with self._lock:
            return self._tokens + (self._clock() - self._last) * self.rate >= self.burst


def retry_after_ms(wait_s: float) -> int:
    return max(1, math.ceil(wait_s * 1000))


def retry_after_header(wait_s: float) -> str:
    return str(max(1, math.ceil(wait_s)))
