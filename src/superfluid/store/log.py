"""The durable session log: every committed event of every session, in SQLite.

One table, `events`, holds the records in commit order (`seq`); everything else the
daemon knows about a session is replayed from it. The database runs in WAL mode with
`synchronous=FULL`, so a transaction is on disk (fsynced) when `append` returns, and
the caller publishes events only after that. Bodies are stored as the JSON form of
`EventBody`, so `sqlite3 sessions.db 'select * from events'` reads like the protocol.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..protocol import jsoncodec
from ..protocol.schema import EventBody, EventMsg

SCHEMA_VERSION = 1

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
"""


class StoreLocked(RuntimeError):
    """Another daemon already serves this sessions directory."""


@dataclass(frozen=True)
class Record:
    """One row of the log: an event of a session."""

    session: int
    event: EventMsg


class SessionLog:
    """Append-only, fsynced event log of all sessions under one directory."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / "sessions.db"
        self._lock_file = _take_lock(directory / "serve.lock")
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version not in (0, SCHEMA_VERSION):
            raise RuntimeError(
                f"{self.path} has schema version {version}; this superfluid reads version "
                f"{SCHEMA_VERSION}. Move the directory aside or use a newer superfluid."
            )
        self._db.executescript(_SCHEMA)
        self._db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        self.store_id = self._store_id()

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
        cursor = self._db.execute("SELECT session, event_id, epoch, ts_unix_ms, body FROM events ORDER BY seq")
        for session, event_id, epoch, ts, body in cursor:
            yield Record(session, EventMsg(event_id, epoch, ts, jsoncodec.loads(body, EventBody)))

    def append(self, records: Sequence[Record]) -> None:
        """Write records in one transaction; durable on disk when this returns."""
        if not records:
            return
        rows = [
            (r.session, r.event.event_id, r.event.epoch, r.event.ts_unix_ms, jsoncodec.dumps(r.event.body, EventBody))
            for r in records
        ]
        db = self._db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT INTO events (session, event_id, epoch, ts_unix_ms, body) VALUES (?, ?, ?, ?, ?)", rows
            )
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def close(self) -> None:
        self._db.close()
        self._lock_file.close()


def _take_lock(path: Path, wait_s: float = 3.0) -> object:
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
