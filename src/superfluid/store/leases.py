"""Sessions leased to daemons, so that several daemons share one PostgreSQL log safely.

A session is served by one daemon at a time: the one holding its row in `leases` (owner:
this run of the daemon; daemon: the daemon across its runs, an id kept under --sessions;
the address clients of the session API reach it at, and that of its HTTP API; a fencing
epoch; an expiry on the server's clock). A
daemon takes a session's lease when it first serves it, renews all of its leases in the
background, and gives them up at a clean stop. A lease that ran out (its daemon died,
paused or lost the network) is taken by the next daemon asked for the session, which
bumps the epoch; a daemon started again takes its earlier run's leases back at once.
Every append checks, in its own transaction and under a share lock on the lease rows,
that this daemon still holds each session at the epoch it took: a daemon that lost a
lease has its writes refused, so no two daemons ever commit to one session.

Times are the database server's (`clock_timestamp()`), so the daemons' clocks never matter.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("superfluid.store")

RENEW_S = 2.0
EXPIRY_S = 10.0

LEASES_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    session    BIGINT PRIMARY KEY,
    owner      TEXT NOT NULL,
    daemon     TEXT NOT NULL,
    address    TEXT NOT NULL,
    epoch      BIGINT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_owner ON leases (owner);
ALTER TABLE leases ADD COLUMN IF NOT EXISTS api TEXT NOT NULL DEFAULT '';
"""

# Take a session: a new row, or the row of a lease that ran out (or of an earlier run of
# this daemon, dead since), with the epoch bumped; nothing otherwise.
_TAKE = """
INSERT INTO leases AS l (session, owner, daemon, address, api, epoch, expires_at)
VALUES (%(session)s, %(owner)s, %(daemon)s, %(address)s, %(api)s, 1,
        clock_timestamp() + make_interval(secs => %(expiry)s))
ON CONFLICT (session) DO UPDATE
    SET owner = EXCLUDED.owner, daemon = EXCLUDED.daemon, address = EXCLUDED.address, api = EXCLUDED.api,
        expires_at = EXCLUDED.expires_at,
        epoch = CASE WHEN l.owner = EXCLUDED.owner THEN l.epoch ELSE l.epoch + 1 END
    WHERE l.owner = EXCLUDED.owner OR l.daemon = EXCLUDED.daemon OR l.expires_at < clock_timestamp()
RETURNING epoch
"""
# Rows are locked in session order, by renewals and appends alike, so that they never deadlock.
_RENEW = """
UPDATE leases SET expires_at = clock_timestamp() + make_interval(secs => %(expiry)s), address = %(address)s,
    api = %(api)s
WHERE session IN (SELECT session FROM leases WHERE owner = %(owner)s ORDER BY session FOR UPDATE)
RETURNING session, epoch
"""


class SessionElsewhere(RuntimeError):
    """The session is leased to another live daemon, which clients reach at `address` (its HTTP API
    at `api`, '' when it has none)."""

    def __init__(self, session: int, address: str, api: str = "") -> None:
        where = f"at {address}" if address else "that advertises no address"
        if address.startswith("unix:"):
            where = f"through its socket {address} (it serves no --web, or gives no --advertise)"
        super().__init__(f"session {session} is served by another daemon, {where}; send its requests there")
        self.session = session
        self.address = address
        self.api = api


class LeaseLost(RuntimeError):
    """This daemon no longer holds the session's lease: its write was refused, nothing was committed."""

    def __init__(self, sessions: Iterable[int]) -> None:
        self.sessions = sorted(sessions)
        listed = ", ".join(map(str, self.sessions))
        super().__init__(
            f"this daemon lost the lease of session {listed} (paused or cut off past its expiry) and another "
            "daemon may serve it now: the write was refused; send the request again"
        )


def daemon_id(directory: Path) -> str:
    """This daemon's name across its runs: an id kept in `directory` (its --sessions), made once."""
    path = directory / "daemon-id"
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        directory.mkdir(parents=True, exist_ok=True)
        name = uuid.uuid4().hex
        path.write_text(name)
        return name


@dataclass(frozen=True)
class LeaseTiming:
    """How often leases are renewed and how long one lasts unrenewed."""

    renew_s: float = RENEW_S
    expiry_s: float = EXPIRY_S


class Leases:
    """This daemon's leases in one PostgreSQL store: taken, checked in appends, renewed, released."""

    def __init__(
        self, run: Callable[[Callable[[Any], Any]], Any], address: str, timing: LeaseTiming, daemon: str
    ) -> None:
        """`run(work)` calls `work(db)` on a pooled connection (retried while the server is away);
        `address` is what clients sent here by another daemon are told (and `api`, set once the HTTP
        listener is up, where other daemons forward HTTP requests); `daemon` names this daemon across
        its runs."""
        self._run = run
        self.owner = uuid.uuid4().hex
        self.daemon = daemon
        self.address = address
        self.api = ""
        self.timing = timing
        self.held: dict[int, int] = {}  # session -> the epoch this daemon took it at
        self._lock = threading.Lock()
        self.on_lost: Callable[[list[int]], None] = lambda sessions: None
        self.on_commit: Callable[[int], None] = lambda session: None  # another daemon committed to it
        self.on_missed: Callable[[], None] = lambda: None  # announcements may have been missed
        self.takeovers = 0  # sessions taken from a daemon whose lease ran out
        self.lost = 0  # sessions whose lease this daemon found taken, or let run out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def holds(self, session: int) -> bool:
        return session in self.held

    def take(self, session: int) -> bool:
        """Take the session's lease (SessionElsewhere when another live daemon holds it); True when it
        was not this run's before (a run of a daemon, this one's earlier run included, may have cut a
        turn short)."""
        if session in self.held:
            return False

        def work(db: Any) -> tuple[Any, Any]:
            query = "SELECT owner, address, daemon, api FROM leases WHERE session = %s"
            before = db.execute(query, (session,)).fetchone()
            return db.execute(_TAKE, self._params(session)).fetchone(), before

        taken, before = self._run(work)
        if taken is None:
            raise SessionElsewhere(session, before[1], before[3]) if before else SessionElsewhere(session, "")
        if before is not None and before[2] != self.daemon:
            self.takeovers += 1
            log.info("took session %d over from the daemon at %s: its lease ran out", session, before[1] or "?")
        with self._lock:
            self.held[session] = int(taken[0])
        return before is None or before[0] != self.owner

    def release_one(self, session: int) -> None:
        """Give a lease up that was taken for nothing (a session the log does not hold)."""
        self.forget([session])
        self._run(lambda db: db.execute("DELETE FROM leases WHERE session = %s AND owner = %s", (session, self.owner)))

    def check(self, db: Any, sessions: set[int], started: set[int]) -> dict[int, int]:
        """Inside an append's transaction: lease the sessions it starts (their epochs returned), and
        check it holds the others at the epoch it took them (their rows share-locked until the
        commit, so no takeover slips in)."""
        epochs = {}
        for session in sorted(started):
            row = db.execute(_TAKE, self._params(session)).fetchone()
            if row is None:  # a new id another daemon leased first: nothing of it is written
                raise LeaseLost([session])
            epochs[session] = int(row[0])
        others = sorted(sessions - started)
        if others:
            rows = db.execute(
                "SELECT session, epoch FROM leases WHERE owner = %s AND session = ANY(%s) ORDER BY session FOR SHARE",
                (self.owner, others),
            ).fetchall()
            found = {int(session): int(epoch) for session, epoch in rows}
            with self._lock:
                held = {s: self.held.get(s) for s in others}
            lost = [s for s in others if held[s] is None or found.get(s) != held[s]]
            if lost:
                self.lost += sum(1 for s in lost if held[s] is not None)
                raise LeaseLost(lost)
        return epochs

    def committed(self, epochs: dict[int, int]) -> None:
        """An append that started these sessions committed: they are held at the epochs taken."""
        with self._lock:
            self.held.update(epochs)

    def forget(self, sessions: Iterable[int]) -> None:
        with self._lock:
            for session in sessions:
                self.held.pop(session, None)

    def _params(self, session: int) -> dict[str, Any]:
        return {
            "session": session,
            "owner": self.owner,
            "daemon": self.daemon,
            "address": self.address,
            "api": self.api,
            "expiry": self.timing.expiry_s,
        }

    # ---- renewal ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="superfluid-leases", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        """Extend every lease this daemon holds; those it no longer holds are reported as lost."""
        with self._lock:
            judged = dict(self.held)  # what is taken while the renewal runs is not judged by it
        params = {"expiry": self.timing.expiry_s, "owner": self.owner, "address": self.address, "api": self.api}
        rows = self._run(lambda db: db.execute(_RENEW, params).fetchall())
        found = {int(session): int(epoch) for session, epoch in rows}
        with self._lock:
            lost = [s for s, epoch in judged.items() if found.get(s) != epoch and self.held.get(s) == epoch]
            for session in lost:
                del self.held[session]
        if lost:
            self.lost += len(lost)
            log.warning("lost the lease of %d session(s) to another daemon: %s", len(lost), lost[:10])
            self.on_lost(lost)

    def _renew_loop(self) -> None:
        last_renewed = time.monotonic()
        while not self._stop.wait(self.timing.renew_s):
            try:
                self.renew()
                last_renewed = time.monotonic()
            except Exception as e:  # the store is away: appends fail too, and the leases run out
                log.warning("could not renew the session leases: %s", e)
                if time.monotonic() - last_renewed > self.timing.expiry_s and self.held:
                    with self._lock:
                        lost, self.held = list(self.held), {}
                    self.lost += len(lost)
                    log.warning("the leases ran out unrenewed: %d session(s) will be taken again", len(lost))
                    self.on_lost(lost)

    def release(self) -> None:
        """Give every lease up (a clean stop): another daemon takes the sessions at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            self.held.clear()
        self._run(lambda db: db.execute("DELETE FROM leases WHERE owner = %s", (self.owner,)))
