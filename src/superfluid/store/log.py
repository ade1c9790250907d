"""The durable session log: what every implementation offers, and what they share.

The log is the truth: every committed event of every session, in commit order. Everything
else the daemon knows about a session is replayed from it, one session at a time when it is
first used. `SessionLog` is the interface; `SqliteLog` (sqlite.py, the default, one daemon
per sessions directory) and `PostgresLog` (postgres.py, `--store postgresql://...`, shared by
several daemons) implement it. Both keep `lineage`, a view of the log written in the same
transactions (each session's parent and pin deadline), so start-up reads no event; what a
record changes there is derived once, here (`lineage_changes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..protocol import jsoncodec
from ..protocol.schema import EventBody, EventMsg
from .leases import Leases

B = EventBody
# the records that move `lineage`, as their bodies' JSON begins
LINEAGE_KINDS = ("Created", "Forked", "Rebased", "Rerooted", "Pinned", "Purged")


class StoreLocked(RuntimeError):
    """Another daemon already serves this sessions directory."""


@dataclass(frozen=True)
class Record:
    """One row of the log: an event of a session."""

    session: int
    event: EventMsg


class SessionLog(Protocol):
    """Append-only event log of all sessions: an append is durable when it returns."""

    store_id: bytes

    @property
    def leases(self) -> Leases | None:
        """None: this daemon is the log's only writer (read-only here, so a log that always
        has leases may declare them as `Leases`)."""
        ...

    def empty(self) -> bool: ...

    def replay(self) -> Iterator[Record]:
        """Every record in commit order."""
        ...

    def records_of(self, session: int, before: int | None = None) -> list[tuple[int, Record]]:
        """One session's records with their sequence numbers; only those before `before` if given."""
        ...

    def events_from(self, session: int, event_id: int) -> list[EventMsg]:
        """One session's events from `event_id` on."""
        ...

    def reserve_session(self) -> int:
        """A session id nobody has used, for a record that starts a session."""
        ...

    def session_count(self) -> int: ...

    def sessions(self) -> list[int]:
        """Every session's id, purged ones included, in id order."""
        ...

    def children_of(self, session: int) -> list[int]: ...

    def pinned(self, after_unix_ms: int) -> list[int]: ...

    def rebuild_lineage(self) -> None: ...

    def append(self, records: Sequence[Record]) -> None:
        """Write records in one transaction; durable when this returns."""
        ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Parent:
    """A session starts under `parent` (None: a root)."""

    session: int
    parent: int | None


@dataclass(frozen=True)
class Rerooted:
    """A session no longer has a parent."""

    session: int


@dataclass(frozen=True)
class Pin:
    """A session's pin deadline (0: none)."""

    session: int
    deadline_unix_ms: int


def lineage_changes(record: Record) -> list[Parent | Rerooted | Pin]:
    """What one record changes in `lineage`."""
    body, session = record.event.body, record.session
    if isinstance(body, (B.Created, B.Forked, B.Rebased)):
        return [Parent(session, body.parent)]
    if isinstance(body, B.Rerooted):
        return [Rerooted(session)]
    if isinstance(body, B.Pinned):
        return [Pin(session, body.deadline_unix_ms)]
    if isinstance(body, B.Purged):
        return [Pin(session, 0)]
    return []


# An `events` row as both logs store it: session, event_id, epoch, ts_unix_ms, body (its JSON),
# and, as read back, seq.
EventRow = tuple[int, int, int, int, str]


def event_row(record: Record) -> EventRow:
    """The row a record is written as."""
    event = record.event
    return record.session, event.event_id, event.epoch, event.ts_unix_ms, jsoncodec.dumps(event.body, EventBody)


def sequenced(rows: Iterable[tuple[Any, ...]]) -> Iterator[tuple[int, Record]]:
    """Rows read back (the columns of `event_row`, then seq) as records with their seq."""
    for session, event_id, epoch, ts, body, seq in rows:
        yield (
            int(seq),
            Record(int(session), EventMsg(int(event_id), int(epoch), int(ts), jsoncodec.loads(body, EventBody))),
        )


def lineage_filter(placeholder: str) -> tuple[str, list[str]]:
    """A WHERE clause selecting the records that move `lineage`, and its parameters, in a driver's
    placeholder style (`?` or `%s`)."""
    return " OR ".join(f"body LIKE {placeholder}" for _ in LINEAGE_KINDS), [f'{{"{k}":%' for k in LINEAGE_KINDS]


def move_lineage(db: Any, record: Record, statements: dict[type, str]) -> None:
    """Apply what one record changes in `lineage`, with a log's own SQL for each kind of change."""
    for change in lineage_changes(record):
        db.execute(statements[type(change)], vars(change))
