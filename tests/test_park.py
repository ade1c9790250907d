"""KV parked on disk: files that fail a check are refused and deleted, a torn write is never
loaded, the budget drops the least recently used, and a session comes back warm after a
SIGKILL with the very tokens a prefill gives; the default parks only on a local disk with room."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
from conftest import HttpDaemon, forced, generate, generated_tokens, new_session, say

from superfluid.client import SocketClient
from superfluid.metrics import read_metric
from superfluid.protocol.schema import FINISH_CANCELLED, Request, Response, Tier
from superfluid.scheduler import park as park_module
from superfluid.scheduler.park import Park, default_budget, filesystem_type, park_fingerprint
from superfluid.scheduler.prefix_cache import HostCache

FINGERPRINT = park_fingerprint("model", 1)
TOKENS = np.arange(100, 164, dtype=np.int32)
STATE = bytes(range(256)) * 64


def parked(directory: Path, *tokens: np.ndarray, budget: int = 0) -> Park:
    park = Park(directory, FINGERPRINT, budget)
    for t in tokens or (TOKENS,):
        park.put(t, STATE)
    park.flush()
    return park


def test_a_parked_state_reads_back_and_a_prefix_finds_it(tmp_path: Path) -> None:
    park = parked(tmp_path)
    found = park.lookup(np.concatenate([TOKENS, [7, 8]]), 1000)
    assert found is not None and found[1] == len(TOKENS)
    assert park.read(found[0]) == STATE and park.resumes == 1
    again = Park(tmp_path, FINGERPRINT, 0)  # a restart indexes what is on disk
    found = again.lookup(TOKENS, 10)
    assert found is not None and found[1] == 10 and again.read(found[0]) == STATE
    assert again.bytes == park.bytes == found[0].size > len(STATE)


def test_truncated_flipped_and_foreign_files_are_refused_and_deleted(tmp_path: Path) -> None:
    park = parked(tmp_path)
    (entry,) = park.entries.values()
    data = entry.path.read_bytes()
    entry.path.write_bytes(data[:-100])
    assert park.read(entry) is None and not entry.path.exists() and park.refused == 1
    assert park.lookup(TOKENS, 100) is None and park.bytes == 0

    park = parked(tmp_path)
    (entry,) = park.entries.values()
    flipped = bytearray(entry.path.read_bytes())
    flipped[-7] ^= 0x10
    entry.path.write_bytes(bytes(flipped))
    assert park.read(entry) is None and not entry.path.exists() and park.refused == 1

    parked(tmp_path)
    other = Park(tmp_path, park_fingerprint("another model", 1), 0)
    other.flush()  # the files a restart finds are indexed on the writer thread
    assert other.entries == {} and other.refused == 1 and list(tmp_path.iterdir()) == []


def test_a_write_cut_by_a_crash_is_never_loaded(tmp_path: Path) -> None:
    parked(tmp_path)
    (path,) = tmp_path.iterdir()
    torn = tmp_path / f".{path.name}.4242.tmp"  # what a SIGKILL before the rename leaves
    torn.write_bytes(path.read_bytes()[:50])
    path.unlink()
    park = Park(tmp_path, FINGERPRINT, 0)
    park.flush()
    assert park.entries == {} and list(tmp_path.iterdir()) == []


def test_the_least_recently_used_go_first_past_the_budget(tmp_path: Path) -> None:
    first, second, third = (np.arange(n, n + 40, dtype=np.int32) for n in (1000, 2000, 3000))
    park = parked(tmp_path, first, second)
    size = next(iter(park.entries.values())).size
    found = park.lookup(first, 40)
    assert found is not None and park.read(found[0]) == STATE  # first is now the most recent
    time.sleep(0.01)
    park.budget = 2 * size
    park.put(third, STATE)
    park.flush()
    assert park.holds(first) and park.holds(third) and not park.holds(second)
    assert park.bytes == 2 * size


def test_a_writer_behind_by_the_limit_passes_states_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = threading.Event()  # the disk answers when the test says so
    write = Park._write
    monkeypatch.setattr(Park, "_write", lambda self, tokens, state: (disk.wait(10), write(self, tokens, state)))
    monkeypatch.setattr(park_module, "PENDING_LIMIT", 2 * len(STATE))
    park = Park(tmp_path, FINGERPRINT, 0)
    prefixes = [np.arange(n, n + 40, dtype=np.int32) for n in (1000, 2000, 3000, 4000)]
    for tokens in prefixes:
        park.put(tokens, STATE)
    assert park.passed_over == 2, "two states wait for the disk; the others are not held in memory"
    assert park.pending_bytes == 2 * len(STATE)
    disk.set()
    park.flush()
    assert [park.holds(t) for t in prefixes] == [True, True, False, False]
    assert park.pending_bytes == 0, "states on disk leave memory"
    park.put(prefixes[3], STATE)  # the writer caught up: parking goes on
    park.flush()
    assert park.holds(prefixes[3]) and park.passed_over == 2


def test_the_writer_gives_way_while_a_job_waits_for_its_first_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(park_module, "WRITE_PIECE", len(STATE) // 4)  # four pieces, a wait before each
    park = Park(tmp_path, FINGERPRINT, 0)
    waiting = threading.Event()
    waiting.set()
    park.give_way_to = waiting.is_set
    park.put(TOKENS, STATE)
    time.sleep(0.3)
    assert not park.entries and park.pending_bytes == len(STATE), "nothing written while a job waits"
    waiting.clear()
    park.flush()
    assert park.lookup(TOKENS, 100) is not None and park.read(next(iter(park.entries.values()))) == STATE
    # a job that never gets its first token holds each piece back GIVE_WAY_S at most: the state is parked
    monkeypatch.setattr(park_module, "GIVE_WAY_S", 0.05)
    waiting.set()
    other = np.arange(2000, 2064, dtype=np.int32)
    park.put(other, STATE)
    park.flush()
    assert park.holds(other) and park.pending_bytes == 0


@pytest.mark.e2e
def test_a_session_comes_back_warm_from_the_park_after_a_sigkill(tmp_path: Path) -> None:
    daemon = HttpDaemon(tmp_path / "a", max_context=2048, max_batch=2).start()
    try:
        with daemon.client() as c:
            session = new_session(c)
            say(c, session, " ".join(f"Line {i} of a long document about lighthouses." for i in range(60)))
            forced(c, session, 4)
            prompt = len(c.call(Request.Inspect(session)).inspection.tokens)
        # a long prompt is parked as soon as it is prefilled, not after the daemon idles (2 s)
        time.sleep(1.0)
        daemon.kill()
        shutil.copytree(tmp_path / "a" / "sessions", tmp_path / "b" / "sessions")
        daemon.start()
        with daemon.client() as c:
            tier = c.call(Request.Inspect(session)).inspection.tier
            assert isinstance(tier, Tier.Parked) and tier.covered >= 0.9 * prompt, (tier, prompt)
            deltas, summary = forced(c, session, 12)
            assert summary.warm_prefix >= 0.9 * prompt, (summary.warm_prefix, prompt)
            from_park = generated_tokens(deltas)
        assert daemon.metric("superfluid_resumes_total") == 1
        exposition = httpx.get(f"{daemon.url}/metrics").text
        assert read_metric(exposition, "superfluid_park_bytes") > 0
        assert "superfluid_park_pending_bytes" in exposition
    finally:
        daemon.stop()
    cold = HttpDaemon(tmp_path / "b", "--no-park", max_context=2048, max_batch=2).start()
    try:
        with cold.client() as c:
            deltas, summary = forced(c, session, 12)
            assert summary.warm_prefix == 0
            assert generated_tokens(deltas) == from_park, "a resumed state decodes as a prefill does"
    finally:
        cold.stop()


def test_what_host_memory_cannot_keep_goes_to_the_park(tmp_path: Path) -> None:
    park = Park(tmp_path, FINGERPRINT, 0)
    host = HostCache(2 * len(STATE), park.put)
    first, second, third = (np.arange(n, n + 40, dtype=np.int32) for n in (1000, 2000, 3000))
    host.add(first, STATE)
    host.add(second, STATE)
    host.add(np.concatenate([second, [5]]), STATE)  # extends `second`: that one is not parked, it is covered
    park.flush()
    assert park.entries == {}
    host.add(third, STATE)  # over the budget: the least recently used, `first`, goes to the park
    park.flush()
    assert park.holds(first) and not park.holds(second) and len(host) == 2


def test_the_default_parks_on_a_local_disk_with_room_and_within_half_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert filesystem_type(Path("/proc/self")) == "proc"
    free = shutil.disk_usage(tmp_path).free
    if free >= park_module.MIN_FREE_BYTES:
        budget, why = default_budget(tmp_path / "park" / "abc", 1 << 30)  # not created yet: its parent counts
        assert budget == min(1 << 30, free // 2) and why
    gib = 1 << 30

    def usage(free: int) -> Callable[[Path], SimpleNamespace]:
        return lambda _path: SimpleNamespace(free=free)

    monkeypatch.setattr(park_module.shutil, "disk_usage", usage(10 * gib))
    assert default_budget(tmp_path, 20 * gib)[0] == 5 * gib  # never more than half of what is free
    assert default_budget(tmp_path, 0)[0] == 5 * gib  # "unbounded" is bounded by the disk too
    assert default_budget(tmp_path, 1 * gib)[0] == 1 * gib
    monkeypatch.setattr(park_module.shutil, "disk_usage", usage(gib))
    budget, why = default_budget(tmp_path, 20 * gib)
    assert budget == 0 and "free" in why
    monkeypatch.setattr(park_module.shutil, "disk_usage", usage(10 * gib))
    monkeypatch.setattr(park_module, "filesystem_type", lambda _path: "nfs4")
    budget, why = default_budget(tmp_path, 20 * gib)
    assert budget == 0 and "nfs4" in why


@pytest.mark.e2e
def test_a_daemon_that_is_never_idle_parks_too_and_says_its_rates_at_start(tmp_path: Path) -> None:
    daemon = HttpDaemon(tmp_path, max_context=8192, max_batch=2).start()
    try:
        deadline = time.monotonic() + 30  # measured on the scheduler's thread, before its first job
        while "imports parked states at" not in daemon.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "imports parked states at" in daemon.log.read_text(), "the rates the park's choice rests on"
        with daemon.client() as c:
            busy = new_session(c)
            say(c, busy, "Count from one to ten thousand, one number per line.")
            ended: list[Response.Generated] = []

            def run_long() -> None:  # far longer than the test waits, on any machine: it ends by its Cancel
                with SocketClient(daemon.socket) as own:
                    ended.append(generate(own, busy, 8000, ignore_eos=True)[1])

            long_run = threading.Thread(target=run_long)
            long_run.start()
            session = new_session(c)
            say(c, session, " ".join(f"Line {i} of a short note." for i in range(12)))
            forced(c, session, 4)
            deadline = time.monotonic() + 60
            while daemon.metric("superfluid_parks_total") < 1 and time.monotonic() < deadline:
                time.sleep(0.1)
            c.call(Request.Cancel(busy))
            long_run.join(60)
        assert daemon.metric("superfluid_parks_total") >= 1, "a finished session is parked while others run"
        assert ended and ended[0].finish == FINISH_CANCELLED, "the daemon was busy all along"
    finally:
        daemon.stop()
