"""Sessions leased to daemons, so that several daemons share one PostgreSQL log safely.

A session is served by one daemon at a time: the one holding its row in `leases` (owner,
the address clients reach it at, a fencing epoch, an expiry on the server's clock). A
daemon takes a session's lease when it first serves it, renews all of its leases in the
background, and gives them up at a clean stop. A lease that ran out (its daemon died,
paused or lost the network) is taken by the next daemon asked for the session, which
bumps the epoch. Every append checks, in its own transaction and under a share lock on
the lease rows, that this daemon still holds each session at the epoch it took: a daemon
that lost a lease has its writes refused, so no two daemons ever commit to one session.

Times are the database server's (`clock_timestamp()`), so the daemons' clocks never matter.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("superfluid.store")

RENEW_S = 2.0
EXPIRY_S = 10.0

LEASES_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    session    BIGINT PRIMARY KEY,
    owner      TEXT NOT NULL,
    address    TEXT NOT NULL,
    epoch      BIGINT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX IF NOT EXISTS leases_owner ON leases (owner);
"""

# Take a session: a new row, or the row of a lease that ran out (or of an earlier run of
# this daemon at the same address, dead since), with the epoch bumped; nothing otherwise.
_TAKE = """
INSERT INTO leases AS l (session, owner, address, epoch, expires_at)
VALUES (%(session)s, %(owner)s, %(address)s, 1, clock_timestamp() + make_interval(secs => %(expiry)s))
ON CONFLICT (session) DO UPDATE
    SET owner = EXCLUDED.owner, address = EXCLUDED.address, expires_at = EXCLUDED.expires_at,
        epoch = CASE WHEN l.owner = EXCLUDED.owner THEN l.epoch ELSE l.epoch + 1 END
    WHERE l.owner = EXCLUDED.owner OR l.expires_at < clock_timestamp()
       OR (EXCLUDED.address <> '' AND l.address = EXCLUDED.address)
RETURNING epoch
"""
_RENEW = (
    "UPDATE leases SET expires_at = clock_timestamp() + make_interval(secs => %s) WHERE owner = %s "
    "RETURNING session, epoch"
)


class SessionElsewhere(RuntimeError):
    """The session is leased to another live daemon, which clients reach at `address`."""

    def __init__(self, session: int, address: str) -> None:
        where = f"at {address}" if address else "that advertises no address"
        if address.startswith("unix:"):
            where = f"through its socket {address} (it serves no --web, or gives no --advertise)"
        super().__init__(f"session {session} is served by another daemon, {where}; send its requests there")
        self.session = session
        self.address = address


class LeaseLost(RuntimeError):
    """This daemon no longer holds the session's lease: its write was refused, nothing was committed."""

    def __init__(self, sessions: Iterable[int]) -> None:
        self.sessions = sorted(sessions)
        listed = ", ".join(map(str, self.sessions))
        super().__init__(
            f"this daemon lost the lease of session {listed} (paused or cut off past its expiry) and another "
            "daemon may serve it now: the write was refused; send the request again"
        )


@dataclass(frozen=True)
class LeaseTiming:
    """How often leases are renewed and how long one lasts unrenewed."""

    renew_s: float = RENEW_S
    expiry_s: float = EXPIRY_S


class Leases:
    """This daemon's leases in one PostgreSQL store: taken, checked in appends, renewed, released."""

    def __init__(self, run: Callable[[Callable[[Any], Any]], Any], address: str, timing: LeaseTiming) -> None:
        """`run(work)` calls `work(db)` on a pooled connection (retried while the server is away);
        `address` is what clients sent here by another daemon are told."""
        self._run = run
        self.owner = uuid.uuid4().hex
        self.address = address
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

    def take(self, session: int) -> None:
        """Take the session's lease (SessionElsewhere when another live daemon holds it)."""
        if session in self.held:
            return

        def work(db: Any) -> tuple[Any, Any]:
            before = db.execute("SELECT owner, address FROM leases WHERE session = %s", (session,)).fetchone()
            return db.execute(_TAKE, self._params(session)).fetchone(), before

        taken, before = self._run(work)
        if taken is None:
            raise SessionElsewhere(session, before[1] if before else "")
        if before is not None and before[0] != self.owner:
            self.takeovers += 1
            log.info("took session %d over from the daemon at %s: its lease ran out", session, before[1] or "?")
        with self._lock:
            self.held[session] = int(taken[0])

    def check(self, db: Any, sessions: set[int], started: set[int]) -> None:
        """Inside an append's transaction: lease the sessions it starts, and check it holds the others
        at the epoch it took them (their rows share-locked until the commit, so no takeover slips in)."""
        for session in started:
            db.execute(_TAKE, self._params(session))
        others = sorted(sessions - started)
        if others:
            rows = db.execute(
                "SELECT session, epoch FROM leases WHERE owner = %s AND session = ANY(%s) FOR SHARE",
                (self.owner, others),
            ).fetchall()
            found = {int(session): int(epoch) for session, epoch in rows}
            lost = [s for s in others if s not in self.held or found.get(s) != self.held[s]]
            if lost:
                self.lost += sum(1 for s in lost if s in self.held)
                raise LeaseLost(lost)

    def committed(self, started: set[int]) -> None:
        """An append that started these sessions committed: they are held at epoch 1 or the one taken."""
        with self._lock:
            for session in started:
                self.held.setdefault(session, 1)

    def forget(self, sessions: Iterable[int]) -> None:
        with self._lock:
            for session in sessions:
                self.held.pop(session, None)

    def _params(self, session: int) -> dict[str, Any]:
        return {"session": session, "owner": self.owner, "address": self.address, "expiry": self.timing.expiry_s}

    # ---- renewal ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._renew_loop, name="superfluid-leases", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        """Extend every lease this daemon holds; those it no longer holds are reported as lost."""
        rows = self._run(lambda db: db.execute(_RENEW, (self.timing.expiry_s, self.owner)).fetchall())
        found = {int(session): int(epoch) for session, epoch in rows}
        with self._lock:
            lost = [s for s, epoch in self.held.items() if found.get(s) != epoch]
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
