"""Per-session event bus: subscriptions to a session's committed events.

A subscription gets the session's backlog from a cursor, then every event committed
after it, deduplicated by event id, and (when asked) provisional text. Live items wait
in a bounded queue while the subscriber's task delivers; a subscriber that falls 1024
items behind is dropped with `lagged`. Delivery runs on the subscriber's own task, so a
slow reader never holds up a commit.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from ..engine.shaping import LogprobRow
from ..protocol.schema import EventMsg

QUEUE_LIMIT = 1024

END_UNSUBSCRIBED = "unsubscribed"
END_LAGGED = "lagged"
END_PUBLISHER_CLOSED = "publisher closed"
END_PURGED = "purged"


@dataclass(frozen=True)
class Committed:
    """A committed event, durable before anyone sees it."""

    event: EventMsg


@dataclass(frozen=True)
class Provisional:
    """Text ahead of its commit; for a generation that asked, the log probabilities of its tokens."""

    channel: int
    text: str
    logprobs: tuple[LogprobRow, ...] = ()


@dataclass(frozen=True)
class SubEnded:
    """The subscription is over, and why."""

    reason: str


SubItem = Committed | Provisional | SubEnded


@dataclass(eq=False)
class Subscription:
    """One subscriber to one session; items arrive on `queue` in the owner's event loop."""

    id: int
    session: int
    provisional: bool
    loop: asyncio.AbstractEventLoop
    backlog: list[EventMsg] = field(default_factory=list)
    queue: asyncio.Queue[SubItem] = field(default_factory=asyncio.Queue)
    next_id: int = 0
    ended: bool = False

    async def items(self) -> AsyncIterator[SubItem]:
        """The backlog, then live items, ending with `SubEnded`."""
        for event in self.backlog:
            if event.event_id >= self.next_id:
                self.next_id = event.event_id + 1
                yield Committed(event)
        self.backlog = []
        while True:
            item = await self.queue.get()
            if isinstance(item, Committed):
                if item.event.event_id < self.next_id:
                    continue
                self.next_id = item.event.event_id + 1
            yield item
            if isinstance(item, SubEnded):
                return

    def _push(self, item: SubItem) -> None:
        # runs in the owner's loop
        if self.ended:
            return
        if isinstance(item, SubEnded):
            self.ended = True
        elif self.queue.qsize() >= QUEUE_LIMIT:
            self.ended = True
            item = SubEnded(END_LAGGED)
        self.queue.put_nowait(item)


class Bus:
    """Routes committed events and provisional text to the subscribers of each session."""

    def __init__(self) -> None:
        self._subs: dict[int, list[Subscription]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def subscribe(
        self, session: int, cursor: int, provisional: bool, backlog: Callable[[int], list[EventMsg]]
    ) -> Subscription:
        """Attach a subscriber; `backlog(cursor)` is read under the bus lock so no event slips between."""
        sub = Subscription(next(self._ids), session, provisional, asyncio.get_running_loop(), next_id=cursor)
        with self._lock:
            sub.backlog = backlog(cursor)
            self._subs.setdefault(session, []).append(sub)
        return sub

    def _each(self, session: int) -> list[Subscription]:
        with self._lock:
            subs = self._subs.get(session, [])
            subs[:] = [s for s in subs if not s.ended]  # lagged ones drop out here
            return list(subs)

    def watched(self, session: int) -> bool:
        """Whether any subscriber follows the session."""
        return bool(self._each(session))

    def publish(self, session: int, events: list[EventMsg]) -> None:
        for sub in self._each(session):
            for event in events:
                sub.loop.call_soon_threadsafe(sub._push, Committed(event))

    def provisional(self, session: int, channel: int, text: str) -> None:
        for sub in self._each(session):
            if sub.provisional:
                sub.loop.call_soon_threadsafe(sub._push, Provisional(channel, text))

    def end(self, sub: Subscription, reason: str) -> None:
        self._detach(sub)
        sub.loop.call_soon_threadsafe(sub._push, SubEnded(reason))

    def end_session(self, session: int, reason: str) -> None:
        for sub in self._each(session):
            self.end(sub, reason)

    def close(self) -> None:
        with self._lock:
            sessions = list(self._subs)
        for session in sessions:
            self.end_session(session, END_PUBLISHER_CLOSED)

    def _detach(self, sub: Subscription) -> None:
        with self._lock:
            subs = self._subs.get(sub.session, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(sub.session, None)

    def detach(self, sub: Subscription) -> None:
        """Forget a subscriber whose connection closed (nothing more is delivered)."""
        self._detach(sub)
        sub.ended = True
