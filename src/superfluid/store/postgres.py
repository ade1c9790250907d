"""The session log in PostgreSQL (`serve --store postgresql://USER@HOST/DB`): one log for many daemons.

The tables mirror the SQLite log's: `events` in commit order (`seq`), `lineage` kept in the
same transactions, `store` for the store's id and schema version, and a sequence that hands
out session ids to every daemon alike. Connections come from a pool; each runs with
`synchronous_commit = on`, so an append has returned only once its transaction is durable
(on the primary, and on synchronous replicas where the server has them), and the caller
publishes events only after that. The schema is created, and later migrated, by the first
daemon that opens the store, under an advisory lock so that daemons starting together do
not race. Bodies are stored as the JSON form of `EventBody`, as in SQLite.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from ..protocol import jsoncodec
from ..protocol.schema import EventBody, EventMsg
from .log import LINEAGE_KINDS, Parent, Pin, Record, Rerooted, lineage_changes

logger = logging.getLogger("superfluid.store")
SCHEMA_VERSION = 1
SCHEMA_LOCK = 0x53465F4C4F47  # pg_advisory_xact_lock key: "SF_LOG"
POOL_SIZE = 4

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    seq        BIGSERIAL PRIMARY KEY,
    session    BIGINT NOT NULL,
    event_id   BIGINT NOT NULL,
    epoch      BIGINT NOT NULL,
    ts_unix_ms BIGINT NOT NULL,
    body       TEXT NOT NULL,
    UNIQUE (session, event_id)
);
CREATE TABLE IF NOT EXISTS store (
    key   TEXT PRIMARY KEY,
    value BYTEA NOT NULL
);
CREATE TABLE IF NOT EXISTS lineage (
    session              BIGINT PRIMARY KEY,
    parent               BIGINT,
    pin_deadline_unix_ms BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS lineage_parent ON lineage (parent);
CREATE SEQUENCE IF NOT EXISTS session_ids;
"""
_LINEAGE_SQL = {
    Parent: "INSERT INTO lineage (session, parent) VALUES (%(session)s, %(parent)s) "
    "ON CONFLICT (session) DO UPDATE SET parent = EXCLUDED.parent",
    Rerooted: "UPDATE lineage SET parent = NULL WHERE session = %(session)s",
    Pin: "UPDATE lineage SET pin_deadline_unix_ms = %(deadline_unix_ms)s WHERE session = %(session)s",
}
_SELECT = "SELECT session, event_id, epoch, ts_unix_ms, body, seq FROM events"


class PostgresLog:
    """Append-only event log of all sessions in one PostgreSQL database (a `SessionLog`)."""

    def __init__(self, url: str) -> None:
        from psycopg_pool import ConnectionPool  # only a daemon with --store postgresql:// needs it

        self.url = url
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=POOL_SIZE,
            kwargs={"autocommit": True, "options": "-c synchronous_commit=on"},
            open=False,
            name="superfluid-store",
        )
        try:
            self._pool.open(wait=True, timeout=30)
        except Exception as e:
            raise RuntimeError(f"the PostgreSQL store at {redacted(url)} did not answer: {e}") from None
        self.store_id = self._migrate()

    def _migrate(self) -> bytes:
        """Create the schema (or check it), once among daemons opening the store together."""
        with self._pool.connection() as db, db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
            db.execute(_SCHEMA)
            row = db.execute("SELECT value FROM store WHERE key = 'version'").fetchone()
            version = int(bytes(row[0]).decode()) if row else 0
            if version > SCHEMA_VERSION:
                raise RuntimeError(
                    f"the PostgreSQL store at {redacted(self.url)} has schema version {version}; this superfluid "
                    f"reads versions up to {SCHEMA_VERSION}. Use a newer superfluid."
                )
            db.execute(
                "INSERT INTO store (key, value) VALUES ('version', %s) ON CONFLICT (key) DO UPDATE SET value = %s",
                (str(SCHEMA_VERSION).encode(), str(SCHEMA_VERSION).encode()),
            )
            db.execute("INSERT INTO store (key, value) VALUES ('id', %s) ON CONFLICT DO NOTHING", (os.urandom(16),))
            return bytes(db.execute("SELECT value FROM store WHERE key = 'id'").fetchone()[0])

    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        with self._pool.connection() as db:
            return db.execute(query, params).fetchall()

    def empty(self) -> bool:
        return not self._rows("SELECT 1 FROM events LIMIT 1")

    def replay(self) -> Iterator[Record]:
        for _, record in _sequenced(self._rows(f"{_SELECT} ORDER BY seq")):
            yield record

    def records_of(self, session: int, before: int | None = None) -> list[tuple[int, Record]]:
        if before is None:
            return _sequenced(self._rows(f"{_SELECT} WHERE session = %s ORDER BY event_id", (session,)))
        query = f"{_SELECT} WHERE session = %s AND seq < %s ORDER BY event_id"
        return _sequenced(self._rows(query, (session, before)))

    def reserve_session(self) -> int:
        (session,) = self._rows("SELECT nextval('session_ids')")[0]
        return int(session)

    def session_count(self) -> int:
        return int(self._rows("SELECT count(*) FROM lineage")[0][0])

    def sessions(self) -> list[int]:
        return [int(r[0]) for r in self._rows("SELECT session FROM lineage ORDER BY session")]

    def children_of(self, session: int) -> list[int]:
        rows = self._rows("SELECT session FROM lineage WHERE parent = %s ORDER BY session", (session,))
        return [int(r[0]) for r in rows]

    def pinned(self, after_unix_ms: int) -> list[int]:
        rows = self._rows(
            "SELECT session FROM lineage WHERE pin_deadline_unix_ms > %s ORDER BY session", (after_unix_ms,)
        )
        return [int(r[0]) for r in rows]

    def rebuild_lineage(self) -> None:
        like = " OR ".join("body LIKE %s" for _ in LINEAGE_KINDS)
        rows = self._rows(f"{_SELECT} WHERE {like} ORDER BY seq", [f'{{"{kind}":%' for kind in LINEAGE_KINDS])
        with self._pool.connection() as db, db.transaction():
            db.execute("DELETE FROM lineage")
            for _, record in _sequenced(rows):
                _move_lineage(db, record)

    def append(self, records: Sequence[Record]) -> None:
        if not records:
            return
        rows = [
            (r.session, r.event.event_id, r.event.epoch, r.event.ts_unix_ms, jsoncodec.dumps(r.event.body, EventBody))
            for r in records
        ]
        with self._pool.connection() as db, db.transaction():
            with db.cursor() as cursor:
                cursor.executemany(
                    "INSERT INTO events (session, event_id, epoch, ts_unix_ms, body) VALUES (%s, %s, %s, %s, %s)",
                    rows,
                )
            for record in records:
                _move_lineage(db, record)
            # ids that came from elsewhere (a reference log imported) are never handed out again
            if any(isinstance(r.event.body, EventBody.Created) for r in records):
                top = max(r.session for r in records)
                db.execute(
                    "SELECT setval('session_ids', %s) WHERE %s > (SELECT last_value FROM session_ids)", (top, top)
                )

    def close(self) -> None:
        self._pool.close()


def _sequenced(rows: list[tuple[Any, ...]]) -> list[tuple[int, Record]]:
    return [
        (int(seq), Record(int(session), EventMsg(int(event_id), int(epoch), int(ts), jsoncodec.loads(body, EventBody))))
        for session, event_id, epoch, ts, body, seq in rows
    ]


def _move_lineage(db: Any, record: Record) -> None:
    for change in lineage_changes(record):
        db.execute(_LINEAGE_SQL[type(change)], vars(change))


def open_log(url: str) -> PostgresLog:
    """The PostgreSQL log at `url`, as `serve --store` names it."""
    log = PostgresLog(url)
    logger.info("the session log is in PostgreSQL at %s", redacted(url))
    return log


def redacted(url: str) -> str:
    """A connection URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
