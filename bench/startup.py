"""Start-up: how long a daemon killed with SIGKILL takes to serve again, on an empty log and on a
log of 10,000 sessions and a million events (written straight into its tables).

The time runs from starting `superfluid serve` to the first answered `Create` on its socket,
the median of a few starts each; the daemon is killed with SIGKILL before each next start.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import numpy as np
from peer import Superfluid
from record import Result

from superfluid.protocol import jsoncodec
from superfluid.protocol.schema import EventBody, GenParams, Request, Response
from superfluid.store.sqlite import SqliteLog

GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
SESSIONS = 10_000
EVENTS_EACH = 100
STARTS = 5


def write_big_log(directory: Path, sessions: int = SESSIONS, events_each: int = EVENTS_EACH) -> None:
    """`sessions` sessions of `events_each` events each, written straight into the log's tables."""
    SqliteLog(directory).close()  # the schema
    created = jsoncodec.dumps(EventBody.Created(None, GREEDY), EventBody)
    message = jsoncodec.dumps(EventBody.Message(1, "a line of an old conversation", list(range(100, 112))), EventBody)
    db = sqlite3.connect(directory / "sessions.db")
    db.execute("BEGIN")
    for session in range(1, sessions + 1):
        rows = [(session, 0, 1, 1700000000000, created)]
        rows += [(session, i, 1, 1700000000000 + i, message) for i in range(1, events_each)]
        db.executemany("INSERT INTO events (session, event_id, epoch, ts_unix_ms, body) VALUES (?, ?, ?, ?, ?)", rows)
        db.execute("INSERT INTO lineage (session, parent) VALUES (?, NULL)", (session,))
    db.execute("COMMIT")
    db.close()


def served_after_start(daemon: Superfluid) -> float:
    """Seconds from starting the daemon to its socket answering a Create."""
    began = time.monotonic()
    daemon.start()
    with daemon.client() as c:
        assert isinstance(c.call(Request.Create(None, GREEDY)), Response.Created)
    return time.monotonic() - began


def startup_figures(root: Path, threads: int, starts: int | None = None) -> list[Result]:
    starts = starts or STARTS
    rows = []
    big = root / "startup-big"
    (big / "sessions").mkdir(parents=True)
    write_big_log(big / "sessions")
    for label, where in (("an empty log", root / "startup-empty"), (f"{SESSIONS:,} sessions, 1M events", big)):
        daemon = Superfluid(where, 4096, 8, "--threads", str(threads))
        took = []
        for _ in range(starts):
            took.append(served_after_start(daemon))
            assert daemon.proc is not None
            daemon.proc.kill()
            daemon.proc.wait()
        median = float(np.median(took))
        detail = f"median of {starts} starts after a SIGKILL: {', '.join(f'{t:.2f}' for t in took)} s"
        name = f"start-up to a served request, {label} (s)"
        rows.append(Result(name, median, "<= 2 s", median <= 2.0, detail, "s", rounds={"seconds": took}))
    return rows
