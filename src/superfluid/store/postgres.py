"""The session log in PostgreSQL (`serve --store postgresql://USER@HOST/DB`): one log for many daemons.

The tables mirror the SQLite log's: `events` in commit order (`seq`), `lineage` kept in the
same transactions, `store` for the store's id and schema version, and a sequence that hands
out session ids to every daemon alike. Connections come from a pool; each runs with
`synchronous_commit = on`, so an append has returned only once its transaction is durable
(on the primary, and on synchronous replicas where the server has them), and the caller
publishes events only after that. The schema is created, and later migrated, by the first
daemon that opens the store, under an advisory lock so that daemons starting together do
not race. Bodies are stored as the JSON form of `EventBody`, as in SQLite.

Sessions are leased to one daemon at a time (leases.py): every append checks the leases in
its transaction, and announces its sessions on the `superfluid_commits` channel, which each
daemon LISTENs to so that a subscriber on one daemon sees another's commits. A connection the
server dropped (a restart, a failover) is retried for a few seconds before the caller gets
`StoreError`; an append whose commit was cut off is looked up before it is retried.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, cast

from ..protocol.schema import EventBody, EventMsg
from .errors import StoreError
from .leases import LEASES_SCHEMA, Leases, LeaseTiming
from .log import Parent, Pin, Record, Rerooted, event_row, lineage_filter, move_lineage, sequenced
from .responses import RESPONSES_SCHEMA
from .state import FORKS

logger = logging.getLogger("superfluid.store")
SCHEMA_VERSION = 2  # 2: leases
SCHEMA_LOCK = 0x53465F4C4F47  # pg_advisory_xact_lock key: "SF_LOG"
POOL_SIZE = 4
CHANNEL = "superfluid_commits"
RETRY_S = 8.0  # how long a dropped connection is retried before the caller hears of it
CONNECT_S = 2.0  # a wait for a pooled connection, retried within RETRY_S
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 3}
T = TypeVar("T")
STARTS = (EventBody.Created, *FORKS)  # a record that starts a session

_SCHEMA = (
    """
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
    + LEASES_SCHEMA
    + RESPONSES_SCHEMA
)
_LINEAGE_SQL = {
    Parent: "INSERT INTO lineage (session, parent) VALUES (%(session)s, %(parent)s) "
    "ON CONFLICT (session) DO UPDATE SET parent = EXCLUDED.parent",
    Rerooted: "UPDATE lineage SET parent = NULL WHERE session = %(session)s",
    Pin: "UPDATE lineage SET pin_deadline_unix_ms = %(deadline_unix_ms)s WHERE session = %(session)s",
}
_SELECT = "SELECT session, event_id, epoch, ts_unix_ms, body, seq FROM events"


class PostgresLog:
    """Append-only event log of all sessions in one PostgreSQL database (a `SessionLog`)."""

    def __init__(
        self, url: str, address: str = "", timing: LeaseTiming | None = None, daemon: str | None = None
    ) -> None:
        """The log at `url`; `address` is where clients reach this daemon, told to those asking it
        for a session another daemon serves; `daemon` names this daemon across its runs (a new name
        when not given)."""
        import psycopg  # only a daemon with --store postgresql:// needs it
        from psycopg_pool import ConnectionPool

        # a connection lost (PoolTimeout included), or a transaction the server ended: tried again
        self._dropped = (psycopg.OperationalError, psycopg.errors.IdleInTransactionSessionTimeout)
        self._refused = psycopg.Error
        self.url = url
        timing = timing or LeaseTiming()
        # A transaction left open by a daemon that froze (SIGSTOP, a VM paused) would hold its lease
        # rows' locks and stall whoever takes them over: the server ends it when the lease would run out.
        options = f"-c synchronous_commit=on -c idle_in_transaction_session_timeout={int(timing.expiry_s * 1000)}"
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=POOL_SIZE,
            # a server gone silent (a partition) is noticed, not waited on for ever
            kwargs={"autocommit": True, "options": options, "connect_timeout": 5, **KEEPALIVES},
            timeout=CONNECT_S,
            open=False,
            name="superfluid-store",
        )
        try:
            self._pool.open(wait=True, timeout=30)
        except Exception as e:
            raise RuntimeError(f"the PostgreSQL store at {redacted(url)} did not answer: {e}") from None
        self.store_id = self._migrate()
        self.leases = Leases(self.run, address, timing, daemon or uuid.uuid4().hex)
        self.leases.start()
        self._listening = threading.Event()
        self._closing = threading.Event()
        threading.Thread(target=self._listen, name="superfluid-store-listen", daemon=True).start()
        self._listening.wait(10)

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
            # the row is there by construction: inserted just above unless it already was
            row = cast(tuple[Any, ...], db.execute("SELECT value FROM store WHERE key = 'id'").fetchone())
            return bytes(row[0])

    def run(self, work: Callable[[Any], T], landed: Callable[[Any], bool] | None = None) -> T:
        """`work(db)` on a pooled connection, again while the server drops connections (restarting,
        failing over) for up to RETRY_S, then StoreError. For a write, `landed(db)` tells
        whether an attempt cut off at its commit went through after all (it is not written twice)."""
        deadline = time.monotonic() + RETRY_S
        cut_off = False
        while True:
            try:
                with self._pool.connection() as db:
                    if cut_off and landed is not None and landed(db):
                        return None  # type: ignore[return-value]  # a write returns nothing
                    return work(db)
            except self._dropped as e:
                if time.monotonic() > deadline:
                    raise StoreError(f"the PostgreSQL store at {redacted(self.url)} is unreachable: {e}") from None
                if not cut_off:
                    logger.warning("the PostgreSQL store dropped a connection (%s): retrying", str(e).strip())
                cut_off = True
                time.sleep(0.25)
            except self._refused as e:
                raise StoreError(f"the PostgreSQL store at {redacted(self.url)} refused it: {e}") from None

    def shared_token(self) -> str:
        """The web token of every daemon on this store, made by the first that asks."""

        def work(db: Any) -> str:
            db.execute(
                "INSERT INTO store (key, value) VALUES ('web-token', %s) ON CONFLICT DO NOTHING",
                (os.urandom(32).hex().encode(),),
            )
            return bytes(db.execute("SELECT value FROM store WHERE key = 'web-token'").fetchone()[0]).decode()

        return self.run(work)

    def _rows(self, query: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.run(lambda db: db.execute(query, params).fetchall())

    def empty(self) -> bool:
        return not self._rows("SELECT 1 FROM events LIMIT 1")

    def replay(self) -> Iterator[Record]:
        for _, record in sequenced(self._rows(f"{_SELECT} ORDER BY seq")):
            yield record

    def records_of(self, session: int, before: int | None = None) -> list[tuple[int, Record]]:
        if before is None:
            return list(sequenced(self._rows(f"{_SELECT} WHERE session = %s ORDER BY event_id", (session,))))
        query = f"{_SELECT} WHERE session = %s AND seq < %s ORDER BY event_id"
        return list(sequenced(self._rows(query, (session, before))))

    def events_from(self, session: int, event_id: int) -> list[EventMsg]:
        query = f"{_SELECT} WHERE session = %s AND event_id >= %s ORDER BY event_id"
        return [record.event for _, record in sequenced(self._rows(query, (session, event_id)))]

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
        like, patterns = lineage_filter("%s")
        rows = self._rows(f"{_SELECT} WHERE {like} ORDER BY seq", patterns)

        def write(db: Any) -> None:
            with db.transaction():
                db.execute("DELETE FROM lineage")
                for _, record in sequenced(rows):
                    move_lineage(db, record, _LINEAGE_SQL)

        self.run(write)

    def append(self, records: Sequence[Record]) -> None:
        if not records:
            return
        rows = [event_row(r) for r in records]
        sessions = {r.session for r in records}
        started = {r.session for r in records if isinstance(r.event.body, STARTS)}
        # a fork changes its parent's children too
        announced = sessions | {r.event.body.parent for r in records if isinstance(r.event.body, FORKS)}

        epochs: dict[int, int] = {}

        def write(db: Any) -> None:
            with db.transaction():
                epochs.update(self.leases.check(db, sessions, started))
                with db.cursor() as cursor:
                    cursor.executemany(
                        "INSERT INTO events (session, event_id, epoch, ts_unix_ms, body) VALUES (%s, %s, %s, %s, %s)",
                        rows,
                    )
                for record in records:
                    move_lineage(db, record, _LINEAGE_SQL)
                # ids that came from elsewhere (a reference log imported) are never handed out again
                if any(isinstance(r.event.body, EventBody.Created) for r in records):
                    top = max(r.session for r in records)
                    db.execute(
                        "SELECT setval('session_ids', %s) WHERE %s > (SELECT last_value FROM session_ids)", (top, top)
                    )
                # one announcement per session, delivered to the listeners when the transaction commits
                payloads = [f"{self.leases.owner} {session}" for session in sorted(announced)]
                db.execute("SELECT pg_notify(%s, p) FROM unnest(%s::text[]) AS p", (CHANNEL, payloads))

        def landed(db: Any) -> bool:
            first = rows[0]
            found = db.execute(
                "SELECT epoch, body FROM events WHERE session = %s AND event_id = %s", (first[0], first[1])
            ).fetchone()
            return found is not None and (int(found[0]), found[1]) == (first[2], first[4])

        self.run(write, landed)
        self.leases.committed(epochs)

    def _listen(self) -> None:
        """Hear the other daemons' commits (LISTEN), reconnecting while the server is away."""
        import psycopg

        cut_off = False
        while not self._closing.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=5, **KEEPALIVES) as db:
                    db.execute(f"LISTEN {CHANNEL}")
                    if self._listening.is_set():
                        logger.info("hearing the store's commit announcements again")
                        self.leases.on_missed()  # commits made while no one listened
                    self._listening.set()
                    cut_off = False
                    while not self._closing.is_set():
                        for note in db.notifies(timeout=0.5):
                            owner, _, session = note.payload.partition(" ")
                            if owner != self.leases.owner:
                                self.leases.on_commit(int(session))
            except psycopg.Error as e:
                if not self._closing.is_set():
                    if not cut_off:
                        logger.warning("lost the store's commit announcements (%s): reconnecting", str(e).strip())
                    cut_off = True
                    self._closing.wait(0.5)

    def close(self) -> None:
        self._closing.set()
        try:
            self.leases.release()
        except Exception as e:  # the store is away: the leases run out by themselves
            logger.warning("could not release the session leases: %s", e)
        self._pool.close()


def open_log(url: str, address: str, timing: LeaseTiming, daemon: str) -> PostgresLog:
    """The PostgreSQL log at `url`, as `serve --store` names it."""
    log = PostgresLog(url, address, timing, daemon)
    logger.info("the session log is in PostgreSQL at %s", redacted(url))
    return log


def redacted(url: str) -> str:
    """A connection URL without its password, for messages and logs."""
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}{sep}{credentials.split(':', 1)[0]}:***@{host}"
