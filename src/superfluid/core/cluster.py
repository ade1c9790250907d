"""Daemons sharing one PostgreSQL store: other daemons' commits delivered to this one's subscribers.

A subscriber here may follow a session another daemon serves. The store announces every
commit (LISTEN/NOTIFY, postgres.py); for a watched session this daemon does not serve, the
events from the last one delivered are read back from the store and published on the bus,
in order, so the subscriber sees exactly what the log holds. Each new subscription is caught
up once too, which covers a commit announced between its backlog's read and its attachment.
"""

from __future__ import annotations

import logging
import threading

from ..store.sessions import SessionStore
from .bus import Bus

log = logging.getLogger("superfluid.core.cluster")


class RemoteCommits:
    """Publishes on the bus what other daemons commit to the sessions this daemon's subscribers watch."""

    def __init__(self, store: SessionStore, bus: Bus) -> None:
        self.store = store
        self.bus = bus
        self._next: dict[int, int] = {}  # watched session -> the first event id not yet published
        self._lock = threading.Lock()
        if store.leases is not None:
            store.leases.on_commit = self.announced
            store.leases.on_missed = self.missed

    def watch(self, session: int, next_id: int) -> None:
        """A subscriber follows `session` from `next_id`: catch it up with what the store holds (also
        for a session served here, which another daemon may take later)."""
        if self.store.leases is None:
            return  # one daemon: its own commits reach the bus as they are made
        with self._lock:
            self._next[session] = min(self._next.get(session, next_id), next_id)
        self.announced(session)

    def missed(self) -> None:
        """The store's announcements were cut off for a while: read everything watched again."""
        self.store.stale()
        for session in list(self._next):
            self.announced(session)

    def announced(self, session: int) -> None:
        """Another daemon committed to `session` (the store's listener thread, or `watch`)."""
        self.store.stale(session)
        leases = self.store.leases
        with self._lock:
            if session not in self._next or (leases is not None and leases.holds(session)):
                return  # what this daemon commits it publishes itself
            if not self.bus.watched(session):
                del self._next[session]
                return
            try:
                events = self.store.log.events_from(session, self._next[session])
            except Exception as e:  # the store is away: the next announcement, or subscription, catches up
                log.warning("could not read session %d's new events from the store: %s", session, e)
                return
            if events:
                self._next[session] = events[-1].event_id + 1
                self.bus.publish(session, events)
