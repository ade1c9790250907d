"""The session store: commits are durable, and a session loaded when first used is the
state a replay of the whole log in commit order gives."""

from __future__ import annotations

import random
import sqlite3
import threading
from pathlib import Path

import pytest
from conftest import PostgresCluster

from superfluid.protocol.schema import EventBody, EventMsg, GenParams, PurgeMode
from superfluid.protocol.wal import MAGIC, WalCorrupt, encode_record, read_log
from superfluid.store.log import SessionLog, StoreLocked
from superfluid.store.postgres import PostgresLog
from superfluid.store.sessions import RESIDENT_SESSIONS, SessionStore
from superfluid.store.sqlite import SqliteLog
from superfluid.store.state import SessionState, SessionTable

B = EventBody
P = GenParams(0.7, 0.95, 0.0, 20, 5)


def view(s: SessionState) -> tuple:
    return (
        s.parent,
        s.base,
        s.params,
        s.epoch,
        s.events,
        s.tokens,
        s.last_finish,
        s.purged,
        s.meta_version,
        s.title,
        s.archived,
        s.children,
        s.qos_class,
        s.batch_invariant,
        s.pin_deadline_unix_ms,
        s.open_calls,
        s.rerooted,
        s.generation,
    )


def snapshot(store: SessionStore) -> dict:
    """Every session of the store, each loaded (and fenced) as a daemon serving it would."""
    return {sid: view(s) for sid in store.log.sessions() if (s := store.get(sid)) is not None}


class Stores:
    """Opens the store of one test again and again, as restarts do, on SQLite or PostgreSQL, each
    keeping at most `resident` sessions in memory."""

    def __init__(self, directory: Path, url: str | None) -> None:
        self.directory, self.url = directory, url
        self.resident = RESIDENT_SESSIONS

    def log(self) -> SessionLog:
        # one daemon name for every opening: each is this test's daemon started again, taking its sessions back
        return PostgresLog(self.url, daemon="test") if self.url else SqliteLog(self.directory)

    def open(self) -> SessionStore:
        store = SessionStore(self.directory, self.log())
        store.resident = self.resident
        return store


@pytest.fixture(params=["sqlite", "postgresql"])
def stores(request: pytest.FixtureRequest, tmp_path: Path) -> Stores:
    url = request.getfixturevalue("postgres").database() if request.param == "postgresql" else None
    return Stores(tmp_path, url)


def replayed(stores: Stores) -> dict:
    """Every session as one replay of the whole log, in commit order, makes it."""
    log, table = stores.log(), SessionTable()
    for record in log.replay():
        table.apply(record.session, record.event)
    log.close()
    return {sid: view(s) for sid, s in table.sessions.items()}


def kinds(state: SessionState | None) -> list[str]:
    assert state is not None
    return [type(e.body).__name__ for e in state.events]


def test_commit_then_replay_gives_the_same_state(stores: Stores) -> None:
    store = stores.open()
    a = store.reserve_id()
    store.commit([(a, B.Created(None, P))])
    store.commit([(a, B.Message(1, "hi", [10, 11])), (a, B.GenerationPrompt([12]))])
    store.commit([(a, B.Generated([13, 14], "ok", 0, 1))])
    b = store.reserve_id()
    store.commit([(b, B.Forked(a, 2, P))])
    store.commit([(b, B.Message(1, "more", [20]))])
    store.commit([(a, B.MetaUpdated(1, "title", None))])
    store.close()

    again = stores.open()
    fork = again.get(b)
    assert fork is not None and set(again.table.sessions) == {b}, "a session is loaded when first used"
    # the fork holds the parent's events 0..1 by reference, then its own Forked at id 2, then
    # the EpochBump that fences the run before
    assert [e.event_id for e in fork.events] == [0, 1, 2, 3, 4] and kinds(fork)[2:] == [
        "Forked",
        "Message",
        "EpochBump",
    ]
    assert fork.tokens == [10, 11, 20]
    assert fork.events[:2] == again.get(a).events[:2]  # type: ignore[union-attr]
    assert again.get(a).tokens == [10, 11, 12, 13, 14] and again.get(a).children == [b]  # type: ignore[union-attr]
    lazy = snapshot(again)
    again.close()
    assert lazy == replayed(stores)


@pytest.mark.parametrize("resident", [RESIDENT_SESSIONS, 4])
def test_a_session_loaded_when_first_used_is_the_whole_log_replayed(stores: Stores, resident: int) -> None:
    """Forks of forks, rebases, purges of both kinds, reroots, pins and QoS, in a random order; with
    room in memory for all, or for 4 (each other one replayed from the log when next used)."""
    rng = random.Random(7)
    stores.resident = resident
    store = stores.open()
    # the sessions not purged, as the walk made them (asking the store each step, `live()` on a shared log,
    # replays every session out of memory: 30 s here)
    live: list[int] = []
    for _ in range(400):
        action = rng.choice(["create", "fork", "rebase", "append", "append", "meta", "qos", "pin", "purge"])
        if action == "create" or not live:
            sid = store.reserve_id()
            store.commit([(sid, B.Created(None, P)), (sid, B.Message(1, "hi", [rng.randrange(100)]))])
            live.append(sid)
            continue
        s = store.get(rng.choice(live))
        assert s is not None and not s.purged
        if action in ("fork", "rebase"):
            child, at = store.reserve_id(), rng.randrange(1, len(s.events) + 1)
            body = B.Forked(s.id, at, P) if action == "fork" else B.Rebased(s.id, at, P, [])
            store.commit([(child, body), (child, B.Appended(None, [rng.randrange(100)]))])
            live.append(child)
        elif action == "append":
            store.commit([(s.id, B.Appended(None, [rng.randrange(100)]))])
        elif action == "meta":
            store.commit([(s.id, B.MetaUpdated(s.meta_version + 1, f"t{rng.randrange(9)}", rng.random() < 0.3))])
        elif action == "qos":
            store.commit([(s.id, B.QosSet(rng.randrange(4), rng.random() < 0.5))])
        elif action == "pin":
            store.commit([(s.id, B.Pinned(rng.choice([0, 4102444800000])))])
        else:
            cascade = rng.random() < 0.5
            mode = PurgeMode.Cascade() if cascade else PurgeMode.Reroot()
            writes: list[tuple[int, EventBody]] = []
            targets = [s.id]
            if cascade:
                stack = list(s.children)
                while stack:
                    child = store.get(stack.pop())
                    if child is not None and not child.purged:
                        targets.append(child.id)
                        stack += child.children
            else:
                for child_id in s.children:
                    child = store.get(child_id)
                    if child is not None and not child.purged:
                        writes.append(
                            (child_id, B.Rerooted(s.id, [(e.event_id, e.body) for e in child.events[: child.base]]))
                        )
            writes += [(t, B.Purged(store.get(t).generation + 1, mode)) for t in targets]  # type: ignore[union-attr]
            store.commit(writes)
            live = [sid for sid in live if sid not in targets]
        if rng.random() < 0.03:  # a restart now and then: what was in memory is read again, lazily
            store.close()
            store = stores.open()
    assert len(store.table.sessions) <= resident
    store.close()
    again = stores.open()
    pins = {s.id for s in again.pinned()}
    lazy = snapshot(again)
    assert pins == {sid for sid, v in lazy.items() if v[14] and not v[7]}
    count = again.count()
    again.close()
    assert lazy == replayed(stores) and count == len(lazy) > 50


def test_one_commit_may_write_to_more_sessions_than_memory_keeps(stores: Stores) -> None:
    """Loading a session for a commit fences it in a commit of its own, whose trim once dropped the sessions
    the outer commit had loaded before it (a purge rerooting many children failed so)."""
    store = stores.open()
    ids = [store.reserve_id() for _ in range(6)]
    store.commit([(sid, B.Created(None, P)) for sid in ids])
    store.close()
    stores.resident = 4
    store = stores.open()  # a new run: each session is loaded, and fenced, when first written
    fork = store.reserve_id()
    events = store.commit([*((sid, B.Appended(None, [sid])) for sid in ids), (fork, B.Forked(ids[0], 1, P))])
    assert len(events) == 7 and len(store.table.sessions) <= 4
    store.close()
    again = stores.open()
    assert [kinds(again.get(sid)) for sid in ids] == [["Created", "EpochBump", "Appended", "EpochBump"]] * 6
    assert kinds(again.get(fork))[:2] == ["Created", "Forked"]
    again.close()


def test_sessions_past_the_resident_ones_are_dropped_and_replayed_when_next_used(stores: Stores) -> None:
    """Dropped from memory, a session is listed as it was, read whole, fenced only once in a run, and
    forked from; a busy one stays."""
    store = stores.open()
    old = store.reserve_id()
    store.commit([(old, B.Created(None, P)), (old, B.Message(1, "of the run before", [7, 8]))])
    store.close()
    stores.resident = 4
    store = stores.open()
    store.busy = lambda session: session == busy
    busy = store.reserve_id()
    store.commit([(busy, B.Created(None, P))])
    kept = store.get(busy)
    assert kinds(store.get(old)) == ["Created", "Message", "EpochBump"] and store.fenced == 1
    chats = []
    for n in range(12):
        chat = store.reserve_id()
        store.commit([(chat, B.Created(None, P)), (chat, B.Message(1, f"chat {n}", [n, n + 1]))])
        store.commit([(chat, B.MetaUpdated(1, f"title {n}", None))])
        chats.append(chat)
    assert len(store.table.sessions) <= 4 and store.table.sessions[busy] is kept
    assert old not in store.table.sessions and chats[0] not in store.table.sessions
    lines = store.summaries()
    assert [line.id for line in lines] == [old, busy, *chats]
    assert listed_while_a_writer_holds_the_lock(store) == (lines, True), "a listing takes no lock"
    assert [line.title for line in lines[2:]] == [f"title {n}" for n in range(12)]
    assert [len(s.events) for s in store.live()] == [line.events for line in lines] == [3, 1] + [3] * 12
    assert kinds(store.get(old)) == ["Created", "Message", "EpochBump"] and store.fenced == 1, "fenced once"
    fork = store.reserve_id()
    store.commit([(fork, B.Forked(chats[0], 2, P)), (fork, B.Appended(None, [99]))])
    assert store.get(fork).tokens == [0, 1, 99]  # type: ignore[union-attr]
    assert store.get(chats[0]).children == [fork]  # type: ignore[union-attr]
    lazy = snapshot(store)
    store.close()
    assert lazy == replayed(stores)


def listed_while_a_writer_holds_the_lock(store: SessionStore) -> tuple[list, bool]:
    """The listing, and whether it came before the writer (holding the store's lock for 10 s) let go."""
    held, done = threading.Event(), threading.Event()

    def writer() -> None:
        with store.lock:
            held.set()
            done.wait(10)

    thread = threading.Thread(target=writer)
    thread.start()
    held.wait()
    try:
        return store.summaries(), thread.is_alive()
    finally:
        done.set()
        thread.join()


def test_sessions_read_on_a_shared_log_are_kept_within_the_resident_count(postgres: PostgresCluster) -> None:
    url = postgres.database()
    writer = SessionStore(Path("unused"), PostgresLog(url, daemon="writer"))
    ids = [writer.reserve_id() for _ in range(10)]
    writer.commit([w for n, i in enumerate(ids) for w in [(i, B.Created(None, P)), (i, B.Appended(None, [n]))]])
    reader = SessionStore(Path("unused"), PostgresLog(url, daemon="reader"))
    reader.resident = 4
    for n, i in enumerate(ids):
        assert reader.view(i).tokens == [n]  # type: ignore[union-attr]
        assert len(reader.views) <= 4
    assert list(reader.views) == ids[-len(reader.views) :], "the oldest read go first"
    assert [s.tokens for s in reader.live()] == [[n] for n in range(10)]
    assert reader.table.sessions == {}, "reading takes no session"
    reader.close()
    writer.close()


def test_a_log_of_schema_version_1_gets_its_lineage_rebuilt(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    a, b, c = store.reserve_id(), store.reserve_id(), store.reserve_id()
    store.commit([(a, B.Created(None, P)), (a, B.Message(1, "hi", [1, 2])), (a, B.Pinned(4102444800000))])
    store.commit([(b, B.Forked(a, 1, P)), (c, B.Forked(a, 2, P))])
    store.commit([(c, B.Rerooted(a, [])), (b, B.Pinned(4102444800000)), (b, B.Pinned(0))])
    store.close()
    db = sqlite3.connect(tmp_path / "sessions.db")
    db.executescript("DROP TABLE lineage; PRAGMA user_version = 1;")
    db.close()
    again = SessionStore(tmp_path)
    assert again.log.children_of(a) == [b] and again.log.sessions() == [a, b, c]
    assert [s.id for s in again.pinned()] == [a]
    again.close()
    assert sqlite3.connect(tmp_path / "sessions.db").execute("PRAGMA user_version").fetchone()[0] == 2


def test_forked_records_are_not_copied_into_the_log(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    a = store.reserve_id()
    store.commit([(a, B.Created(None, P)), (a, B.Appended("x" * 50, list(range(500))))])
    b = store.reserve_id()
    store.commit([(b, B.Forked(a, 2, P))])
    store.close()
    rows = sqlite3.connect(tmp_path / "sessions.db").execute("SELECT session, event_id FROM events").fetchall()
    assert rows == [(a, 0), (a, 1), (b, 2)]


def test_epoch_bump_fences_every_live_session(stores: Stores) -> None:
    store = stores.open()
    a, b = store.reserve_id(), store.reserve_id()
    store.commit([(a, B.Created(None, P)), (b, B.Created(None, P))])
    store.commit([(b, B.Purged(1, PurgeMode.Cascade()))])
    store.close()
    again = stores.open()
    assert again.fenced == 0, "nothing is read at open"
    assert again.get(b).purged and again.get(b).events == [] and again.fenced == 0  # type: ignore[union-attr]
    assert kinds(again.get(a)) == ["Created", "EpochBump"] and again.fenced == 1
    again.commit([(a, B.Appended(None, [1]))])
    assert [e.epoch for e in again.get(a).events] == [1, 2, 2]  # type: ignore[union-attr]
    again.close()
    third = stores.open()
    assert kinds(third.get(a)) == ["Created", "EpochBump", "Appended", "EpochBump"]
    assert third.get(a).epoch == 3  # type: ignore[union-attr]
    third.close()


def test_session_ids_are_never_reused(stores: Stores) -> None:
    store = stores.open()
    a = store.reserve_id()
    store.commit([(a, B.Created(None, P)), (a, B.Purged(1, PurgeMode.Cascade()))])
    store.close()
    again = stores.open()
    assert again.reserve_id() == a + 1
    again.close()


def test_one_daemon_per_directory(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    with pytest.raises(StoreLocked, match="already open in another superfluid daemon"):
        SessionStore(tmp_path)
    store.close()
    SessionStore(tmp_path).close()


def test_reference_wal_logs_read_with_torn_tail_rules() -> None:
    frames = [encode_record(1, _event(i)) for i in range(3)]
    log = MAGIC + b"".join(frames)
    records, good = read_log(log)
    assert [r.event.event_id for r in records] == [0, 1, 2] and good == len(log)
    # a torn last record is dropped, zero fill included
    torn = MAGIC + frames[0] + frames[1] + frames[2][:-3]
    assert [r.event.event_id for r in read_log(torn)[0]] == [0, 1]
    zeroed = MAGIC + frames[0] + frames[1][:12] + bytes(len(frames[1]) - 12) + bytes(40)
    records, good = read_log(zeroed)
    assert len(records) == 1 and good == len(MAGIC) + len(frames[0])
    # a bad checksum with data after it is corruption, not a torn tail
    bad = bytearray(log)
    bad[len(MAGIC) + 12] ^= 0xFF
    with pytest.raises(WalCorrupt, match="fails its checksum"):
        read_log(bytes(bad))


def test_a_reference_wal_log_is_imported_once(tmp_path: Path) -> None:
    frames = [encode_record(1, _event(i)) for i in range(3)] + [encode_record(2, EventMsg(0, 1, 5, B.Created(1, P)))]
    (tmp_path / "wal.log").write_bytes(MAGIC + b"".join(frames) + b"\x07\x00")  # a torn tail
    store = SessionStore(tmp_path)
    assert store.imported == 4
    assert store.get(1).tokens == [1, 2] and store.get(2).parent == 1  # type: ignore[union-attr]
    store.close()
    again = SessionStore(tmp_path)
    assert again.imported == 0 and kinds(again.get(1)) == ["Created", "Appended", "Appended", "EpochBump", "EpochBump"]
    again.close()


def _event(i: int) -> EventMsg:
    body = B.Created(None, P) if i == 0 else B.Appended(None, [i])
    return EventMsg(i, 1, 1700000000000 + i, body)
