"""The session store: commits are durable and replay rebuilds exactly the same state."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from superfluid.protocol.schema import EventBody, EventMsg, GenParams, PurgeMode
from superfluid.protocol.wal import MAGIC, WalCorrupt, encode_record, read_log
from superfluid.store.log import StoreLocked
from superfluid.store.sessions import SessionStore

B = EventBody
P = GenParams(0.7, 0.95, 0.0, 20, 5)


def snapshot(store: SessionStore) -> dict:
    return {
        sid: (s.parent, s.base, s.params, s.epoch, s.events, s.tokens, s.last_finish, s.purged, s.meta_version, s.title)
        for sid, s in store.table.sessions.items()
    }


def test_commit_then_replay_gives_the_same_state(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    a = store.reserve_id()
    store.commit([(a, B.Created(None, P))])
    store.commit([(a, B.Message(1, "hi", [10, 11])), (a, B.GenerationPrompt([12]))])
    store.commit([(a, B.Generated([13, 14], "ok", 0, 1))])
    b = store.reserve_id()
    store.commit([(b, B.Forked(a, 2, P))])
    store.commit([(b, B.Message(1, "more", [20]))])
    store.commit([(a, B.MetaUpdated(1, "title", None))])
    before = snapshot(store)
    store.close()

    again = SessionStore(tmp_path)
    assert snapshot(again) == before
    fork = again.get(b)
    assert fork is not None
    # the fork holds the parent's events 0..1 by reference, then its own Forked at id 2
    assert [e.event_id for e in fork.events] == [0, 1, 2, 3]
    assert fork.events[:2] == again.get(a).events[:2]  # type: ignore[union-attr]
    assert isinstance(fork.events[2].body, B.Forked)
    assert fork.tokens == [10, 11, 20]
    assert again.get(a).tokens == [10, 11, 12, 13, 14]  # type: ignore[union-attr]
    again.close()


def test_forked_records_are_not_copied_into_the_log(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    a = store.reserve_id()
    store.commit([(a, B.Created(None, P)), (a, B.Appended("x" * 50, list(range(500))))])
    b = store.reserve_id()
    store.commit([(b, B.Forked(a, 2, P))])
    store.close()
    rows = sqlite3.connect(tmp_path / "sessions.db").execute("SELECT session, event_id FROM events").fetchall()
    assert rows == [(a, 0), (a, 1), (b, 2)]


def test_epoch_bump_fences_every_live_session(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    a, b = store.reserve_id(), store.reserve_id()
    store.commit([(a, B.Created(None, P)), (b, B.Created(None, P))])
    store.commit([(b, B.Purged(1, PurgeMode.Cascade()))])
    assert store.bump_epochs() == 1
    store.commit([(a, B.Appended(None, [1]))])
    store.close()
    again = SessionStore(tmp_path)
    events = again.get(a).events  # type: ignore[union-attr]
    assert [type(e.body).__name__ for e in events] == ["Created", "EpochBump", "Appended"]
    assert [e.epoch for e in events] == [1, 2, 2]
    assert again.get(b).purged and again.get(b).events == []  # type: ignore[union-attr]
    again.close()


def test_session_ids_are_never_reused(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    a = store.reserve_id()
    store.commit([(a, B.Created(None, P)), (a, B.Purged(1, PurgeMode.Cascade()))])
    store.close()
    again = SessionStore(tmp_path)
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
    assert again.imported == 0 and len(again.get(1).events) == 3  # type: ignore[union-attr]
    again.close()


def _event(i: int) -> EventMsg:
    body = B.Created(None, P) if i == 0 else B.Appended(None, [i])
    return EventMsg(i, 1, 1700000000000 + i, body)
