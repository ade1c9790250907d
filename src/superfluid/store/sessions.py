"""The session store: the durable log and the state replayed from it, kept in step.

Opening a store reads nothing of the log, so a daemon starts as fast on a million events
as on none. A session is replayed from its own records when it is first used (a fork's
beginning from its parent's records before the fork), kept in memory while it is among the
`resident` most recently used, and fenced at once: a session of an earlier run gets its
`EpochBump` when this run first loads it. One dropped from memory is replayed again when next
used; until then a listing shows the line it had.
`commit` stamps records with their ids, epoch and time, writes them in one fsynced
transaction, then applies them to the in-memory table: a record is in memory (and so
visible to anyone) only once it is on disk.

On a log shared by several daemons (`log.leases` set), a session is replayed and kept only
once this daemon holds its lease (SessionElsewhere names the daemon that does); what only
reads (listings, `view` for Read and Subscribe) replays the others without keeping them.
A session whose lease is lost, or whose commit was cut off, is forgotten, to be replayed
from the log when next used.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ..protocol.schema import EventBody, EventMsg, SessionSummary
from ..protocol.wal import read_log
from .leases import LeaseLost, Leases, SessionElsewhere
from .log import Record, SessionLog
from .sqlite import SqliteLog
from .state import FORKS, SessionState, SessionTable

B = EventBody
log = logging.getLogger("superfluid.store")
# The reference daemon's log file; a sessions directory holding one is imported at first open.
REFERENCE_LOG = "wal.log"
# Sessions kept in memory once used. Every HTTP chat is a session, and one of a short chat holds
# 8.5 KB (tracemalloc): kept for good, the bench's ten-minute soak grew the daemon by 12 KB a
# request. Past this many, the least recently used are dropped down to three quarters of it.
RESIDENT_SESSIONS = 256


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class SessionStore:
    """Durable sessions: each replayed from the log when first used, extended by `commit`."""

    def __init__(self, directory: Path, log: SessionLog | None = None) -> None:
        """The sessions under `directory` (media and park files stay there), their log in SQLite
        there too unless another `log` is given."""
        self.directory = directory
        self.log = log if log is not None else SqliteLog(directory)
        self.table = SessionTable()
        self.resident = RESIDENT_SESSIONS
        self.busy: Callable[[int], bool] = lambda session: False  # sessions never dropped (generating)
        # sessions this run dropped from memory (fenced already), each with its line in a listing (None: purged)
        self._dropped: dict[int, SessionSummary | None] = {}
        self._uses = itertools.count(1)
        self.views: dict[int, SessionState] = {}  # on a shared log: sessions read, not served here
        self.on_commit: Callable[[int, list[EventMsg]], None] = lambda session, events: None  # what the store writes
        if self.log.leases is not None:
            # a lost lease's sessions are replayed when next used; their runs end at their next commit
            self.log.leases.on_lost = self.forget
        # Writers hold `lock` from their checks through their commit, so a session changes under one
        # writer at a time; readers never take it (a record is applied only once it is on disk).
        self.lock = threading.RLock()
        self._writing: set[int] = set()  # the sessions of the commits in progress (a load commits inside one)
        self._all_loaded = False  # every session of the log is in `table` (a log of its own only)
        self.imported = self._import_reference_log(directory / REFERENCE_LOG)
        self.fenced = 0  # sessions of earlier runs loaded (and given their EpochBump) so far

    def _import_reference_log(self, path: Path) -> int:
        """A sessions directory of the reference daemon: take its `wal.log` in, once."""
        if not path.is_file() or not self.log.empty():
            return 0
        records, good = read_log(path.read_bytes())
        self.log.append([Record(r.session, r.event) for r in records])
        log.info(
            "imported %d records of %s (%d bytes, %d torn at the end)",
            len(records),
            path,
            good,
            path.stat().st_size - good,
        )
        return len(records)

    @property
    def store_id(self) -> bytes:
        return self.log.store_id

    @property
    def leases(self) -> Leases | None:
        return self.log.leases

    def get(self, session_id: int) -> SessionState | None:
        """The session, served by this daemon from now on (SessionElsewhere when another serves it)."""
        state = self.table.sessions.get(session_id)
        if state is None and session_id > 0:
            with self.lock:
                self._load([session_id])
                state = self.table.sessions.get(session_id)
        if state is not None:
            state.last_used = next(self._uses)
        return state

    def view(self, session_id: int) -> SessionState | None:
        """The session as the log has it, to read: this daemon's copy when it serves the session,
        else a replay that is not kept (and takes no lease)."""
        if self.leases is None:
            return self.get(session_id)
        return self._viewed([session_id]).get(session_id)

    def _viewed(self, session_ids: Sequence[int]) -> dict[int, SessionState]:
        """Sessions to read: those served here as they are, the others from `views`, replayed when
        missing (the store's announcements drop a view when another daemon commits to its session).
        No lock: the log's pool serves replays beside commits, and two readers replaying one view
        at once only replay it twice."""
        found = {}
        for session_id in session_ids:
            state = self.table.sessions.get(session_id) or self.views.get(session_id)
            if state is None:
                state = self._read(session_id)
                if state is not None:
                    self.views[session_id] = state
                    if len(self.views) > self.resident:  # the oldest read go
                        for oldest in list(self.views)[: len(self.views) - self.trimmed_to]:
                            self.views.pop(oldest, None)
            if state is not None:
                found[session_id] = state
        return found

    def stale(self, session_id: int | None = None) -> None:
        """Another daemon committed to the session (None: maybe to any): its view is read again."""
        if session_id is None:
            self.views.clear()
        else:
            self.views.pop(session_id, None)

    def live(self) -> list[SessionState]:
        """Sessions not purged, in id order: those in memory as they are, the others replayed to read."""
        if self.leases is not None:
            return [s for _, s in sorted(self._viewed(self.log.sessions()).items()) if not s.purged]
        with self.lock:  # the dropped ones stay dropped while they are read
            self._load_all()
            found = dict(self.table.sessions)
            for session_id, line in self._dropped.items():
                state = self._read(session_id) if line is not None else None
                if state is not None:
                    found[session_id] = state
        return [s for _, s in sorted(found.items()) if not s.purged]

    def summaries(self) -> list[SessionSummary]:
        """A line for each session not purged, in id order (a session dropped from memory is not replayed)."""
        if self.leases is not None:
            return [s.summary() for s in self.live()]
        self._load_all()
        # No lock: a session enters memory or `_dropped` before it leaves the other, so reading memory,
        # `_dropped`, then memory again finds each one (memory's line being the newer).
        resident = list(self.table.sessions.items())
        lines = dict(list(self._dropped.items()))
        resident += list(self.table.sessions.items())
        lines.update((i, None if s.purged else s.summary()) for i, s in resident)
        return [line for _, line in sorted(lines.items()) if line is not None]

    def _load_all(self) -> None:
        """Every session of the log in memory or dropped from it, once (alone on its log, this daemon sees
        every later session come through its own commits)."""
        if not self._all_loaded:
            with self.lock:
                if not self._all_loaded:
                    self._load([i for i in self.log.sessions() if i not in self._dropped])
                    self._all_loaded = True

    def pinned(self) -> list[SessionState]:
        """Live sessions whose pin has not run out (on a shared log, read without taking them: any
        daemon may serve them next)."""
        read = self.get if self.leases is None else self.view
        return [s for s in map(read, self.log.pinned(now_ms())) if s is not None and not s.purged]

    def forget(self, session_ids: Sequence[int]) -> None:
        """Drop sessions from memory (their lease lost, or a commit cut off): replayed when next used."""
        with self.lock:
            for session_id in session_ids:
                self.table.sessions.pop(session_id, None)
                self._dropped.pop(session_id, None)
            if self.leases is not None:
                self.leases.forget(session_ids)

    def count(self) -> int:
        """Sessions in the log, purged ones included."""
        return self.log.session_count()

    def _load(self, session_ids: Sequence[int]) -> None:
        """Replay the sessions not in memory yet, and fence the live ones of another run (on SQLite,
        all of them) with an EpochBump, in one transaction; subscribers are told of the bumps."""
        fenced = []
        for session_id in session_ids:
            if session_id not in self.table.sessions:
                moved = True
                if self.leases is not None:
                    moved = self.leases.take(session_id)  # before the replay: nobody else writes to it after
                    self.views.pop(session_id, None)
                state = self._read(session_id)
                if state is None:
                    if self.leases is not None:
                        self.leases.release_one(session_id)  # no such session: nothing to hold
                    continue
                state.last_used = next(self._uses)
                self.table.sessions[session_id] = state  # in memory before it leaves `_dropped` (`summaries`)
                fenced_already = session_id in self._dropped  # this run dropped it
                self._dropped.pop(session_id, None)
                if moved and not state.purged and not fenced_already:
                    fenced.append(state)
        events = self.commit([(s.id, B.EpochBump()) for s in fenced])
        for state, event in zip(fenced, events, strict=True):
            self.on_commit(state.id, [event])
        self.fenced += len(fenced)

    @property
    def trimmed_to(self) -> int:
        """What a trim leaves: three quarters of `resident`, so that one is not paid at every commit."""
        return self.resident * 3 // 4

    def _trim(self) -> None:
        """Past `resident` sessions in memory, drop the least recently used that are not busy, down to
        `trimmed_to`."""
        sessions = self.table.sessions
        if len(sessions) <= self.resident:
            return
        excess = len(sessions) - self.trimmed_to
        for state in sorted(sessions.values(), key=lambda s: s.last_used):
            if excess == 0:
                break
            if not self.busy(state.id) and state.id not in self._writing:
                self._dropped[state.id] = None if state.purged else state.summary()  # before it leaves memory
                del sessions[state.id]
                excess -= 1

    def _read(self, session_id: int) -> SessionState | None:
        """A session replayed from the log, with its children."""
        state = self._replay(session_id)
        if state is not None:
            state.children = self.log.children_of(session_id)
        return state

    def _replay(self, session_id: int, before: int | None = None) -> SessionState | None:
        """A session from its own records (those before `before` only, if given); None if it has none.

        A fork begins with its parent's events as they stood when it was forked, so the parent
        is replayed up to that record, whatever happened to it after (a purge, say).
        """
        records = self.log.records_of(session_id, before)
        if not records:
            return None
        scratch = SessionTable()
        seq, first = records[0]
        if isinstance(first.event.body, FORKS):
            parent = self._replay(first.event.body.parent, seq)
            if parent is None:
                raise RuntimeError(f"session {session_id} forks from session {first.event.body.parent}, not in the log")
            scratch.sessions[parent.id] = parent
        for _, record in records:
            scratch.apply(session_id, record.event)
        return scratch.sessions[session_id]

    def _served(self, session_id: int) -> SessionState | None:
        """A session written to that is not in memory: loaded, or LeaseLost when another daemon took it
        (a write of a session this daemon forgot when it lost the lease)."""
        try:
            return self.get(session_id)
        except SessionElsewhere:
            raise LeaseLost([session_id]) from None

    def reserve_id(self) -> int:
        """A fresh session id for a record that starts a session (Created, Forked, Rebased)."""
        return self.log.reserve_session()

    def commit(self, writes: Sequence[tuple[int, EventBody]]) -> list[EventMsg]:
        """Append records (session id, body) in one transaction; returns the committed events."""
        with self.lock:
            # a session this commit loads commits its fence first, whose trim must not drop the sessions
            # (and forks' parents) of this one: they are applied to memory once the records are on disk
            outer = self._writing
            self._writing = outer | {s for s, _ in writes} | {b.parent for _, b in writes if isinstance(b, FORKS)}
            try:
                events = self._commit(writes)
            finally:
                self._writing = outer
            self._trim()
            return events

    def _commit(self, writes: Sequence[tuple[int, EventBody]]) -> list[EventMsg]:
        """`commit`, under the lock."""
        ts = now_ms()
        pending: dict[int, tuple[int, int]] = {}  # session -> (next event id, epoch)
        records = []
        for session_id, body in writes:
            if isinstance(body, B.Created):
                event_id, epoch = 0, 1
            elif isinstance(body, FORKS):
                event_id, epoch = body.fork_at, 1
                self.get(body.parent)  # a fork begins from its parent's state, served here
            elif session_id in pending:
                event_id, epoch = pending[session_id]
            else:
                state = self.table.sessions.get(session_id) or self._served(session_id)
                if state is None:
                    raise KeyError(f"session {session_id} is not in the log")
                event_id, epoch = state.next_id, state.epoch
            if isinstance(body, B.EpochBump):
                epoch += 1  # the run that writes it starts a new epoch of the session
            pending[session_id] = (event_id + 1, epoch)
            records.append(Record(session_id, EventMsg(event_id, epoch, ts, body)))
        try:
            self.log.append(records)
        except LeaseLost as e:
            self.forget(e.sessions)
            raise
        except Exception:
            if self.leases is not None:  # the commit may have landed: what is in memory may be behind
                self.forget(sorted(pending))
            raise
        for record in records:
            self.table.apply(record.session, record.event)
        used = next(self._uses)
        for session_id in pending:
            self.table.sessions[session_id].last_used = used
        return [r.event for r in records]

    def close(self) -> None:
        self.log.close()
