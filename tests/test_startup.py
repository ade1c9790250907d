"""Start-up does not grow with the log: a daemon on 10,000 sessions and a million events is
serving as soon as one on an empty directory, and loads each session when it is first used."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from conftest import GREEDY, DaemonProcess, new_session, say

from superfluid.protocol.schema import Request, Response

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from startup import EVENTS_EACH, SESSIONS, write_big_log  # bench/startup.py: the same log the bench starts on

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # about 30 s: a log of a million events, and two starts


def started(root: Path) -> tuple[DaemonProcess, float]:
    """A daemon on `root`, and how long it took until its socket serves."""
    began = time.monotonic()
    daemon = DaemonProcess(root, max_context=1024, max_batch=2).start()
    with daemon.client() as c:
        assert isinstance(c.call(Request.Create(None, GREEDY)), Response.Created)
    return daemon, time.monotonic() - began


def test_a_million_events_start_as_fast_as_none(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.mkdir()
    write_big_log(big / "sessions")
    empty_daemon, empty = started(tmp_path / "empty")
    empty_daemon.stop()
    daemon, loaded = started(big)
    try:
        print(f"start-up to a served request: empty {empty:.2f} s, {SESSIONS} sessions {loaded:.2f} s")
        assert loaded < 1.5 * empty + 0.5, (loaded, empty)
        assert f"({SESSIONS} in the log)" in daemon.log.read_text()
        with daemon.client() as c:
            assert c.call(Request.Create(None, GREEDY)).session == SESSIONS + 2, "ids go on after the log's"
            events = c.call(Request.Read(SESSIONS // 2, 0)).events
            assert len(events) == EVENTS_EACH + 1 and type(events[-1].body).__name__ == "EpochBump"
            assert events[-1].epoch == 2, "a session of an earlier run is fenced when first used"
            session = new_session(c)
            say(c, session, "Still here.")
    finally:
        daemon.stop()
