"""The session log in SQLite: every committed event of every session, in one file.

One table, `events`, holds the records in commit order (`seq`); everything else the
daemon knows about a session is replayed from it, one session at a time when it is first
used. `lineage` is a view of the log kept in the same transactions, so a start-up does
not read the log: each session's parent (NULL for a root, or once rerooted) and pin
deadline, to find a session's children and the pins to re-arm. It can always be rebuilt
from `events` (`rebuild_lineage`, which the upgrade from schema version 1 runs).

The database runs in WAL mode with `synchronous=FULL`, so a transaction is on disk
(fsynced) when `append` returns, and the caller publishes events only after that. Bodies
are stored as the JSON form of `EventBody`, so `sqlite3 sessions.db 'select * from
events'` reads like the protocol.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from ..protocol.schema import EventMsg
from .leases import Leases
from .log import Parent, Pin, Record, Rerooted, StoreLocked, event_row, lineage_filter, move_lineage, sequenced

SCHEMA_VERSION = 2  # 2 added `lineage`

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq        INTEGER PRIMARY KEY,
    session    INTEGER NOT NULL,
    event_id   INTEGER NOT NULL,
    epoch      INTEGER NOT NULL,
    ts_unix_ms INTEGER NOT NULL,
    body       TEXT NOT NULL,
    UNIQUE (session, event_id)
);
CREATE TABLE IF NOT EXISTS store (
    key   TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS lineage (
    session              INTEGER PRIMARY KEY,
    parent               INTEGER,
    pin_deadline_unix_ms INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS lineage_parent ON lineage (parent);
"""


class SqliteLog:
    """Append-only, fsynced event log of all sessions under one directory (a `SessionLog`)."""

    leases: Leases | None = None  # one daemon holds the directory's lock: every session is its own

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / "sessions.db"
        self._lock_file = _take_lock(directory / "serve.lock")
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has schema version {version}; this superfluid reads versions up to "
                f"{SCHEMA_VERSION}. Move the directory aside or use a newer superfluid."
            )
        self._db.executescript(_SCHEMA)
        if version == 1:
            self.rebuild_lineage()
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self.store_id = self._store_id()
        self._next_session = self.last_session() + 1  # one daemon per directory: ids are counted here
        self._reserving = threading.Lock()

    def _store_id(self) -> bytes:
        row = self._db.execute("SELECT value FROM store WHERE key = 'id'").fetchone()
        if row is not None:
            return bytes(row[0])
        store_id = os.urandom(16)
        self._db.execute("INSERT INTO store (key, value) VALUES ('id', ?)", (store_id,))
        return store_id

    def empty(self) -> bool:
        return self._db.execute("SELECT 1 FROM events LIMIT 1").fetchone() is None

    def replay(self) -> Iterator[Record]:
        """Every record in commit order."""
        yield from self._records("SELECT session, event_id, epoch, ts_unix_ms, body, seq FROM events ORDER BY seq")

    def records_of(self, session: int, before: int | None = None) -> list[tuple[int, Record]]:
        """One session's records in commit order, with their `seq`; only those before `before` if given."""
        query = "SELECT session, event_id, epoch, ts_unix_ms, body, seq FROM events WHERE session = ?"
        if before is None:
            return list(self._sequenced(query + " ORDER BY event_id", session))
        return list(self._sequenced(query + " AND seq < ? ORDER BY event_id", session, before))

    def events_from(self, session: int, event_id: int) -> list[EventMsg]:
        query = "SELECT session, event_id, epoch, ts_unix_ms, body, seq FROM events WHERE session = ? AND event_id >= ?"
        return [record.event for record in self._records(query + " ORDER BY event_id", session, event_id)]

    def _records(self, query: str, *params: object) -> Iterator[Record]:
        for _, record in self._sequenced(query, *params):
            yield record

    def _sequenced(self, query: str, *params: object) -> Iterator[tuple[int, Record]]:
        return sequenced(self._db.execute(query, params))

    def last_session(self) -> int:
        """The highest session id the log holds, 0 when it holds none."""
        return self._db.execute("SELECT coalesce(max(session), 0) FROM events").fetchone()[0]

    def reserve_session(self) -> int:
        with self._reserving:
            session, self._next_session = self._next_session, self._next_session + 1
            return session

    def session_count(self) -> int:
        return self._db.execute("SELECT count(*) FROM lineage").fetchone()[0]

    def sessions(self) -> list[int]:
        """Every session's id, purged ones included, in id order."""
        return [row[0] for row in self._db.execute("SELECT session FROM lineage ORDER BY session")]

    def children_of(self, session: int) -> list[int]:
        """Sessions started from `session` (created or forked with it as parent) and not rerooted since."""
        rows = self._db.execute("SELECT session FROM lineage WHERE parent = ? ORDER BY session", (session,))
        return [row[0] for row in rows]

    def pinned(self, after_unix_ms: int) -> list[int]:
        """Sessions pinned until later than `after_unix_ms`."""
        rows = self._db.execute(
            "SELECT session FROM lineage WHERE pin_deadline_unix_ms > ? ORDER BY session", (after_unix_ms,)
        )
        return [row[0] for row in rows]

    def rebuild_lineage(self) -> None:
        """Derive `lineage` again from the records that move it."""
        like, patterns = lineage_filter("?")
        query = f"SELECT session, event_id, epoch, ts_unix_ms, body, seq FROM events WHERE {like} ORDER BY seq"
        records = list(self._records(query, *patterns))
        with self._transaction() as db:
            db.execute("DELETE FROM lineage")
            for record in records:
                move_lineage(db, record, _LINEAGE_SQL)

    def append(self, records: Sequence[Record]) -> None:
        """Write records in one transaction; durable on disk when this returns."""
        if not records:
            return
        rows = [event_row(r) for r in records]
        with self._transaction() as db:
            db.executemany(
                "INSERT INTO events (session, event_id, epoch, ts_unix_ms, body) VALUES (?, ?, ?, ?, ?)", rows
            )
            for record in records:
                move_lineage(db, record, _LINEAGE_SQL)

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: committed (fsynced) when the block ends, rolled back if it raises."""
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()
        self._lock_file.close()


_LINEAGE_SQL = {
    Parent: "INSERT OR REPLACE INTO lineage (session, parent) VALUES (:session, :parent)",
    Rerooted: "UPDATE lineage SET parent = NULL WHERE session = :session",
    Pin: "UPDATE lineage SET pin_deadline_unix_ms = :deadline_unix_ms WHERE session = :session",
}


def _take_lock(path: Path, wait_s: float = 3.0) -> TextIO:
    handle = open(path, "a+")  # noqa: SIM115 - held for the life of the log
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return handle
        except BlockingIOError:
            if time.monotonic() >= deadline:
                handle.close()
                raise StoreLocked(
                    f"{path.parent} is already open in another superfluid daemon; "
                    "stop it or pass a different --sessions directory"
                ) from None
            time.sleep(0.02)
