"""The session store: the durable log and the state replayed from it, kept in step.

`commit` stamps records with their ids, epoch and time, writes them in one fsynced
transaction, then applies them to the in-memory table: a record is in memory (and so
visible to anyone) only once it is on disk.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..protocol.schema import EventBody, EventMsg
from ..protocol.wal import read_log
from .log import Record, SessionLog
from .state import SessionState, SessionTable

B = EventBody
log = logging.getLogger("superfluid.store")
# The reference daemon's log file; a sessions directory holding one is imported at first open.
REFERENCE_LOG = "wal.log"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class SessionStore:
    """Durable sessions: replayed at open, extended by `commit`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.log = SessionLog(directory)
        self.table = SessionTable()
        self.lock = threading.RLock()
        self.imported = self._import_reference_log(directory / REFERENCE_LOG)
        for record in self.log.replay():
            self.table.apply(record.session, record.event)
        self._reserved = self.table.next_session_id

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

    def get(self, session_id: int) -> SessionState | None:
        return self.table.sessions.get(session_id)

    def live(self) -> list[SessionState]:
        """Sessions not purged, in id order."""
        return [s for _, s in sorted(self.table.sessions.items()) if not s.purged]

    def reserve_id(self) -> int:
        """A fresh session id for a record that starts a session (Created, Forked, Rebased)."""
        with self.lock:
            session_id = max(self._reserved, self.table.next_session_id)
            self._reserved = session_id + 1
            return session_id

    def commit(self, writes: Sequence[tuple[int, EventBody]]) -> list[EventMsg]:
        """Append records (session id, body) in one transaction; returns the committed events."""
        with self.lock:
            ts = now_ms()
            pending: dict[int, tuple[int, int]] = {}  # session -> (next event id, epoch)
            records = []
            for session_id, body in writes:
                if isinstance(body, B.Created):
                    event_id, epoch = 0, 1
                elif isinstance(body, (B.Forked, B.Rebased)):
                    event_id, epoch = body.fork_at, 1
                elif session_id in pending:
                    event_id, epoch = pending[session_id]
                else:
                    state = self.table.sessions[session_id]
                    event_id, epoch = state.next_id, state.epoch
                pending[session_id] = (event_id + 1, epoch)
                records.append(Record(session_id, EventMsg(event_id, epoch, ts, body)))
            self.log.append(records)
            for record in records:
                self.table.apply(record.session, record.event)
            return [r.event for r in records]

    def bump_epochs(self) -> int:
        """At start: every live session gets an EpochBump, fencing the previous run."""
        with self.lock:
            live = self.live()
            ts = now_ms()
            records = [Record(s.id, EventMsg(s.next_id, s.epoch + 1, ts, B.EpochBump())) for s in live]
            self.log.append(records)
            for record in records:
                self.table.apply(record.session, record.event)
            return len(records)

    def close(self) -> None:
        self.log.close()
