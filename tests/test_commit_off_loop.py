"""The event loop never waits on a commit: with every PostgreSQL commit slowed to 200 ms on purpose,
a `Read` or `List` on another socket connection still answers at once while appends and a
generation commit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psycopg
import pytest
from conftest import DaemonProcess, PostgresCluster, forced, new_session, say

from superfluid.protocol.schema import Request, Response

pytestmark = pytest.mark.e2e

COMMIT_S = 0.2
READ_P99_S = 0.020
READS = 200

# Each statement that inserts into `events` (every commit writes one) sleeps first: a slow disk, or
# a database across a slow network, as the daemon sees it.
SLOW_COMMITS = f"""
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep({COMMIT_S}); RETURN NULL; END $$;
CREATE TRIGGER slow_commit AFTER INSERT ON events FOR EACH STATEMENT EXECUTE FUNCTION slow_commit();
"""


def test_reads_answer_at_once_while_every_commit_takes_200_ms(tmp_path: Path, postgres: PostgresCluster) -> None:
    store = postgres.database()
    daemon = DaemonProcess(tmp_path / "daemon", "--store", store).start()
    try:
        reader, writer, generator = daemon.client(), daemon.client(), daemon.client()
        read, written, generated = (new_session(reader) for _ in range(3))
        for session in (read, written, generated):
            say(reader, session, "Tell me about the history of lighthouses.")
        with psycopg.connect(store, autocommit=True) as db:
            db.execute(SLOW_COMMITS)
        started = time.perf_counter()
        say(writer, written, "And of canals.")
        assert time.perf_counter() - started >= COMMIT_S, "the commits are slowed"

        busy = threading.Event()
        busy.set()

        def append() -> None:
            while busy.is_set():
                say(writer, written, "More, please.")

        def generate() -> None:
            forced(generator, generated, 48)  # each tick's commit takes 200 ms too

        threads = [threading.Thread(target=append), threading.Thread(target=generate)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both are committing
        latencies = []
        for i in range(READS):
            started = time.perf_counter()
            reply = reader.call(Request.Read(read, 0) if i % 2 else Request.List())
            latencies.append(time.perf_counter() - started)
            assert isinstance(reply, (Response.Events, Response.Sessions)), reply
            time.sleep(0.005)
        busy.clear()
        for thread in threads:
            thread.join(timeout=120)
        latencies.sort()
        p99 = latencies[int(READS * 0.99) - 1]
        assert p99 < READ_P99_S, f"reads took {p99 * 1000:.1f} ms at p99 (median {latencies[READS // 2] * 1000:.1f} ms)"
        assert isinstance(reader.call(Request.Read(generated, 0)), Response.Events)
    finally:
        daemon.stop()
