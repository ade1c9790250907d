"""End to end over the unix socket, on the real embedded model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    GREEDY,
    DaemonProcess,
    WebDaemon,
    end_turn,
    forced,
    generate,
    generated_tokens,
    new_session,
    say,
    text_of,
)

from superfluid.client import SocketClient
from superfluid.protocol.schema import (
    FINISH_CANCELLED,
    FINISH_LENGTH,
    EventBody,
    GenParams,
    PurgeMode,
    RebaseEdit,
    Request,
    Response,
    Tier,
)

pytestmark = pytest.mark.e2e

B = EventBody
QUESTION = "Write a long story about a lighthouse keeper and the sea."


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def store_kind(request: pytest.FixtureRequest) -> str:
    """Every test here runs on both session logs: SQLite under --sessions, and PostgreSQL (--store)."""
    return request.param


def store_flags(kind: str, request: pytest.FixtureRequest) -> tuple[str, ...]:
    return () if kind == "sqlite" else ("--store", request.getfixturevalue("postgres").database())


@pytest.fixture
def store(store_kind: str, request: pytest.FixtureRequest) -> tuple[str, ...]:
    """The flags of a daemon that a test starts itself: a fresh database each time, on PostgreSQL."""
    return store_flags(store_kind, request)


@pytest.fixture(scope="module")
def daemon(
    store_kind: str, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WebDaemon]:
    proc = WebDaemon(tmp_path_factory.mktemp("daemon"), *store_flags(store_kind, request)).start()
    yield proc
    proc.stop()


def kinds(events: list) -> list[str]:
    return [type(e.body).__name__ for e in events]


def test_create_message_generate_read(sf: SocketClient) -> None:
    session = new_session(sf)
    message = say(sf, session, "Name three rivers.").event
    assert message.event_id == 1 and message.epoch == 1
    body = message.body
    assert isinstance(body, B.Message) and body.role == 1 and body.text == "Name three rivers."
    assert body.span, "a message records the tokens it put on the model's input"

    deltas, summary = forced(sf, session, 24)
    assert deltas == summary.events
    assert deltas[-1].body.finish == summary.finish
    assert all(e.body.finish == 0 for e in deltas[:-1])

    events = sf.call(Request.Read(session, 0)).events
    assert kinds(events)[:4] == ["Created", "Message", "GenerationFingerprint", "GenerationPrompt"]
    assert events[4:] == deltas
    assert [e.event_id for e in events] == list(range(len(events)))
    assert sf.call(Request.Read(session, 3)).events == events[3:]
    assert sf.call(Request.Read(session, 999)).events == []

    inspection = sf.call(Request.Inspect(session)).inspection
    spans = [t for e in events if hasattr(e.body, "span") for t in e.body.span]
    assert inspection.tokens == spans, "the model input is exactly the concatenation of the spans"
    assert inspection.summary.events == len(events) and inspection.params == GREEDY


def test_a_cut_greedy_generation_continues_token_for_token(sf: SocketClient) -> None:
    whole = new_session(sf)
    say(sf, whole, QUESTION)
    uncut, _ = forced(sf, whole, 48)
    reference = generated_tokens(uncut)

    cut = new_session(sf)
    say(sf, cut, QUESTION)
    first, _ = forced(sf, cut, 20)
    before = sf.call(Request.Read(cut, 0)).events
    rest, rest_summary = forced(sf, cut, 28)
    after = sf.call(Request.Read(cut, len(before))).events
    assert "GenerationPrompt" not in kinds(after), "continuing an open turn adds no opener"
    assert generated_tokens(first) + generated_tokens(rest) == reference
    stream = sf.call(Request.Inspect(cut)).inspection.summary.tokens
    assert rest_summary.warm_prefix == stream - rest_summary.tokens_generated - 1, "a continuation is warm"


def test_a_cut_sampled_generation_with_the_same_seed_draws_the_same(sf: SocketClient) -> None:
    params = GenParams(0.9, 0.95, 0.0, 40, 4242)
    whole = new_session(sf, params)
    say(sf, whole, QUESTION)
    reference = generated_tokens(forced(sf, whole, 40)[0])

    cut = new_session(sf, params)
    say(sf, cut, QUESTION)
    first = generated_tokens(forced(sf, cut, 13)[0])
    rest = generated_tokens(forced(sf, cut, 27)[0])
    assert first + rest == reference

    other = new_session(sf, GenParams(0.9, 0.95, 0.0, 40, 4243))
    say(sf, other, QUESTION)
    assert generated_tokens(forced(sf, other, 40)[0]) != reference, "the seed matters"


def test_a_finished_turn_then_a_message_then_a_new_turn(daemon: WebDaemon, sf: SocketClient) -> None:
    session = new_session(sf)
    say(sf, session, "Say hello.")
    end_turn(daemon, session)
    follow = say(sf, session, "Again.").event.body
    separator = follow.span[:2]
    plain = say(sf, new_session(sf), "Again.").event.body.span
    assert follow.span[2:] != plain[2:] or separator != plain[:2]
    generate(sf, session, 4)
    events = sf.call(Request.Read(session, 0)).events
    prompts = [e for e in events if isinstance(e.body, B.GenerationPrompt)]
    assert len(prompts) == 2
    assert prompts[0].body.span == prompts[1].body.span


def test_fork_shares_history_and_starts_warm(sf: SocketClient) -> None:
    parent = new_session(sf)
    say(sf, parent, "You are reading a document about tides. " * 20)
    generate(sf, parent, 8)
    head = len(sf.call(Request.Read(parent, 0)).events)

    child = sf.call(Request.Fork(parent, head, None)).session
    events = sf.call(Request.Read(child, 0)).events
    parent_events = sf.call(Request.Read(parent, 0)).events
    assert events[:head] == parent_events, "a fork holds its parent's events, same ids"
    assert isinstance(events[head].body, B.Forked) and events[head].event_id == head
    assert events[head].body.fork_at == head and events[head].body.params == GREEDY

    say(sf, child, "Summarise it.")
    _, summary = generate(sf, child, 6)
    shared = sf.call(Request.Inspect(parent)).inspection.summary.tokens
    assert summary.warm_prefix >= 0.9 * shared

    early = sf.call(Request.Fork(parent, 2, GenParams(0.5, 0.9, 0.0, 10, 9))).session
    early_events = sf.call(Request.Read(early, 0)).events
    assert early_events[:2] == parent_events[:2] and early_events[2].body.params.seed == 9
    nodes = sf.call(Request.Tree()).nodes
    assert (child, parent, head) in nodes and (early, parent, 2) in nodes


def test_forks_taken_right_after_a_generation_start_warm(tmp_path: Path, store: tuple[str, ...]) -> None:
    proc = DaemonProcess(tmp_path, *store).start()  # a fresh daemon: its slots hold only what this test left
    try:
        with proc.client() as c:
            session = new_session(c, GenParams(0.0, 0.95, 0.0, 0, 1))
            system = say(c, session, "You are a code reviewer.", role=0).event.body.span
            user = say(c, session, "def add(a, b): return a - b").event.body.span
            generate(c, session, 24)
            first = c.call(Request.Fork(session, 3, GenParams(0.0, 0.95, 0.0, 0, 2))).session
            _, summary = generate(c, first, 16)
            assert summary.warm_prefix >= len(system) + len(user)
            second = c.call(Request.Fork(session, 3, GenParams(0.0, 0.95, 0.0, 0, 2))).session
            say(c, second, "Focus on security.")
            _, summary = generate(c, second, 16)
            assert summary.warm_prefix >= len(system) + len(user), "the shared messages come from the cache"
    finally:
        proc.stop()


def test_rebase_replace_and_drop(sf: SocketClient) -> None:
    session = new_session(sf)
    q = say(sf, session, "What is the capital of France?").event
    generate(sf, session, 6)
    say(sf, session, "And of Spain?")
    original = sf.call(Request.Read(session, 0)).events
    head = len(original)

    replace = Request.Rebase(session, [RebaseEdit.Replace(q.event_id, head, 1, "What is the capital of Italy?")], None)
    edited = sf.call(replace).session
    events = sf.call(Request.Read(edited, 0)).events
    assert kinds(events) == ["Created", "Rebased", "Message"]
    assert events[0] == original[0]
    assert events[1].event_id == q.event_id and events[1].body.edits == replace.edits
    assert events[2].body.text == "What is the capital of Italy?" and events[2].event_id == 2

    dropped = sf.call(Request.Rebase(session, [RebaseEdit.Drop(2, 4)], None)).session
    copied = sf.call(Request.Read(dropped, 0)).events
    assert copied[:2] == original[:2]
    assert isinstance(copied[2].body, B.Rebased)
    assert [e.body for e in copied[3:]] == [e.body for e in original[4:]]
    assert [e.event_id for e in copied] == list(range(len(copied)))
    # the parent is never rewritten
    assert sf.call(Request.Read(session, 0)).events == original


def test_trim(sf: SocketClient) -> None:
    session = new_session(sf)
    say(sf, session, "one")
    say(sf, session, "two")
    say(sf, session, "three")
    original = sf.call(Request.Read(session, 0)).events
    head = len(original)
    trimmed = sf.call(Request.Trim(session, 3)).session
    events = sf.call(Request.Read(trimmed, 0)).events
    assert events[:3] == original[:3] and kinds(events)[3:] == ["Rebased"]
    assert events[3].body.edits == [RebaseEdit.Drop(3, head)]
    whole = sf.call(Request.Trim(session, head)).session
    assert kinds(sf.call(Request.Read(whole, 0)).events)[head:] == ["Forked"]


def test_purge_cascade_and_reroot(sf: SocketClient) -> None:
    root = new_session(sf)
    say(sf, root, "root message")
    child = sf.call(Request.Fork(root, 2, None)).session
    say(sf, child, "child message")
    grandchild = sf.call(Request.Fork(child, 3, None)).session

    stale = sf.call(Request.Purge(child, 5, PurgeMode.Cascade()))
    assert stale == Response.Err(f"session {child} generation is 0, command expected 5")

    keep_root = new_session(sf)
    say(sf, keep_root, "kept")
    kid = sf.call(Request.Fork(keep_root, 2, None)).session
    inherited = sf.call(Request.Read(kid, 0)).events
    assert sf.call(Request.Purge(keep_root, 0, PurgeMode.Reroot())) == Response.Purged([keep_root])
    assert sf.call(Request.Read(keep_root, 0)) == Response.Err(f"session {keep_root} was purged")
    rerooted = sf.call(Request.Read(kid, 0)).events
    assert rerooted[: len(inherited)] == inherited and kinds(rerooted)[-1] == "Rerooted"
    assert sf.call(Request.Inspect(kid)).inspection.summary.parent is None

    assert sf.call(Request.Purge(child, 0, PurgeMode.Cascade())) == Response.Purged([grandchild, child])
    ids = sf.call(Request.List()).ids
    assert root in ids and child not in ids and grandchild not in ids and kid in ids
    assert sf.call(Request.AppendMessage(grandchild, 1, "x")) == Response.Err(f"session {grandchild} was purged")


def test_set_meta_archives_and_versions(sf: SocketClient) -> None:
    session = new_session(sf)
    assert sf.call(Request.SetMeta(session, 0, "notes", None)) == Response.Meta(1)
    assert sf.call(Request.SetMeta(session, 0, "again", None)) == Response.Err(
        f"session {session} metadata version is 1, command expected 0"
    )
    assert sf.call(Request.SetMeta(session, 1, None, True)) == Response.Meta(2)
    summary = sf.call(Request.Inspect(session)).inspection.summary
    assert (summary.title, summary.archived, summary.meta_version) == ("notes", True, 2)
    assert session not in [s.id for s in sf.call(Request.Sessions(False)).sessions]
    assert session in [s.id for s in sf.call(Request.Sessions(True)).sessions]
    assert session not in [n[0] for n in sf.call(Request.Tree()).nodes]
    assert session in sf.call(Request.List()).ids


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda s: Request.Read(999_999, 0), "unknown session 999999"),
        (lambda s: Request.AppendMessage(s, 7, "x"), "unknown message role 7"),
        (lambda s: Request.Fork(s, 0, None), "fork point 0 is outside session {s}'s committed events (1..=2)"),
        (lambda s: Request.Fork(s, 3, None), "fork point 3 is outside session {s}'s committed events (1..=2)"),
        (lambda s: Request.Trim(s, 9), "fork point 9 is outside"),
        (lambda s: Request.Rebase(s, [], None), "rebase edit spec invalid: no edits"),
        (lambda s: Request.Rebase(s, [RebaseEdit.Drop(0, 1)], None), "edits never include Created (id 0)"),
        (lambda s: Request.Rebase(s, [RebaseEdit.Drop(1, 1)], None), "empty range"),
        (lambda s: Request.Rebase(s, [RebaseEdit.Drop(1, 5)], None), "range beyond the parent's committed events"),
        (
            lambda s: Request.Rebase(s, [RebaseEdit.Drop(1, 2), RebaseEdit.Drop(1, 2)], None),
            "ranges must be sorted and non-overlapping",
        ),
        (lambda s: Request.Generate(s, 0), None),
        (lambda s: Request.Append(s, None, []), "Append needs text or a non-empty span"),
        (lambda s: Request.Append(s, None, [10**6]), "token id 1000000 is outside the vocabulary"),
        (lambda s: Request.SetQos(s, 9, False), "unknown QoS class 9"),
        (lambda s: Request.Cancel(s), "session {s} has no generation in flight"),
        (lambda s: Request.Create(999_999, GREEDY), "unknown session 999999"),
        (lambda s: Request.Create(None, GenParams(float("nan"), 1.0, 0.0, 0, 0)), "params.temperature must be"),
        (lambda s: Request.Fork(s, 1, GenParams(0.5, 1.5, 0.0, 0, 0)), "params.top_p must be a number from 0 to 1"),
        (lambda s: Request.AppendSystem(s, None, []), "AppendSystem needs text, tools, or both"),
        (lambda s: Request.AppendSystem(s, "x", ['{"description": 1}']), "tool 0 is not a function declaration"),
        (lambda s: Request.AppendSystem(s, "sys", []), "already has a prompt; AppendSystem must come before"),
    ],
)
def test_bad_input_gets_a_clear_err_and_writes_nothing(sf: SocketClient, make, message: str | None) -> None:
    session = new_session(sf)
    say(sf, session, "hello")
    before = sf.call(Request.Read(session, 0)).events
    reply = sf.call(make(session))
    if message is None:  # Generate with max_tokens 0: an empty summary, nothing committed
        assert reply == Response.Generated([], 0, 0, 0)
    else:
        assert isinstance(reply, Response.Err), reply
        assert message.format(s=session) in reply.message
    assert sf.call(Request.Read(session, 0)).events == before
    assert isinstance(sf.call(Request.List()), Response.Sessions), "the daemon goes on serving"


def test_generate_on_an_empty_session_or_past_the_window(tmp_path: Path, store: tuple[str, ...]) -> None:
    proc = DaemonProcess(tmp_path, *store, max_context=512).start()
    try:
        with proc.client() as sf:
            empty = new_session(sf)
            assert sf.call(Request.Generate(empty, 5)) == Response.Err(
                f"session {empty} has no content to generate from"
            )
            full = new_session(sf)
            sf.call(Request.Append(full, None, [198] * 512))
            assert sf.call(Request.Generate(full, 5)) == Response.Err(
                "this model's maximum context length is 512 tokens, but your request has 512 tokens; "
                "shorten the prompt or drop earlier turns"
            )
            almost = new_session(sf)
            sf.call(Request.Append(almost, None, [198] * 511))
            _, summary = generate(sf, almost, 5, ignore_eos=True)
            assert summary.tokens_generated == 1 and summary.finish == FINISH_LENGTH, "the window fills, then stops"
    finally:
        proc.stop()


def test_busy_session_and_cancel_from_another_connection(daemon: DaemonProcess) -> None:
    with daemon.client() as a, daemon.client() as b:
        session = new_session(a)
        say(a, session, QUESTION)
        a.send(Request.Generate(session, 400, True))
        first = a.receive()
        assert isinstance(first, Response.Delta)
        busy = b.call(Request.AppendMessage(session, 1, "interrupt"))
        assert busy == Response.Err(f"session {session} is generating; append/generate after it finishes or cancel it")
        assert b.call(Request.Generate(session, 5)) == busy
        assert b.call(Request.Cancel(session)) == Response.Cancelling()
        replies = [first]
        while not isinstance(replies[-1], Response.Generated):
            replies.append(a.receive())
        summary = replies[-1]
        assert summary.finish == FINISH_CANCELLED and summary.events[-1].body.finish == FINISH_CANCELLED
        # idle again at once, and the cut turn continues with no new opener
        head = len(b.call(Request.Read(session, 0)).events)
        forced(b, session, 3)
        assert "GenerationPrompt" not in kinds(b.call(Request.Read(session, head)).events)
        assert isinstance(b.call(Request.AppendMessage(session, 1, "next")), Response.Committed)


def test_bad_frames_close_only_their_connection(daemon: DaemonProcess, sf: SocketClient) -> None:
    for garbage in (b"\xff\xff\xff\x7f", (3).to_bytes(4, "little") + b"\x63\x00\x00", b"\x02\x00"):
        raw = socket.socket(socket.AF_UNIX)
        raw.connect(str(daemon.socket))
        raw.sendall(garbage)
        raw.shutdown(socket.SHUT_WR)
        raw.settimeout(10)
        assert raw.recv(100) == b"", "no Err frame; the connection just ends"
        raw.close()
    assert isinstance(sf.call(Request.List()), Response.Sessions)
    assert daemon.alive()


def test_concurrent_sessions_match_their_solo_runs(daemon: DaemonProcess) -> None:
    prompts = ["Tell me about whales.", "Describe a forest at night.", "Explain how bread rises."]
    solo = {}
    with daemon.client() as c:
        for prompt in prompts:
            s = new_session(c)
            say(c, s, prompt)
            solo[prompt] = generated_tokens(forced(c, s, 24)[0])
    threads = []
    results: dict[str, list[int]] = {}

    def run_fresh(prompt: str) -> None:
        with daemon.client() as c:
            s = new_session(c)
            say(c, s, prompt)
            results[prompt] = generated_tokens(forced(c, s, 24)[0])

    for prompt in prompts:
        threads.append(threading.Thread(target=run_fresh, args=(prompt,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == solo


def test_sigkill_mid_generation_loses_nothing_seen(tmp_path: Path, store: tuple[str, ...]) -> None:
    proc = DaemonProcess(tmp_path, *store).start()
    try:
        with proc.client() as c:
            session = new_session(c, GenParams(0.8, 0.95, 0.0, 40, 77))
            say(c, session, QUESTION)
            c.send(Request.Generate(session, 1000, True))
            seen = []
            deadline = time.monotonic() + 60
            while len(generated_tokens(seen)) < 12 and time.monotonic() < deadline:
                reply = c.receive()
                assert isinstance(reply, Response.Delta)
                seen.append(reply.event)
            proc.kill()
        proc.start()
        with proc.client() as c:
            # served again (on a shared store reading alone would not take the session back)
            assert isinstance(c.call(Request.Inspect(session)), Response.Inspection)
            events = c.call(Request.Read(session, 0)).events
            by_id = {e.event_id: e for e in events}
            for event in seen:
                assert by_id[event.event_id] == event, "every event a client saw survives, same id"
            last_seen = seen[-1].event_id
            tail = [e for e in events if e.event_id > last_seen]
            bumps = [e for e in tail if isinstance(e.body, B.EpochBump)]
            assert bumps and bumps[-1].epoch == seen[-1].epoch + 1
            assert kinds(tail)[-1] == "EpochBump"
            inspection = c.call(Request.Inspect(session)).inspection
            assert not isinstance(inspection.tier, Tier.Resident), "nothing is left generating after a restart"
            deltas, _ = forced(c, session, 10)
            after = c.call(Request.Read(session, len(events))).events
            assert "GenerationPrompt" not in kinds(after), "the open turn continues"
            assert deltas[0].epoch == bumps[-1].epoch
    finally:
        proc.stop()


def test_append_system_declares_tools_first(sf: SocketClient) -> None:
    weather = '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}'
    session = new_session(sf)
    event = sf.call(Request.AppendSystem(session, "Answer with the tools.", [weather])).event
    assert event.body.role == 0 and event.body.text == "Answer with the tools."
    plain = new_session(sf)
    bare = sf.call(Request.AppendSystem(plain, "Answer with the tools.", [])).event
    assert len(event.body.span) > len(bare.body.span), "the tool list is part of the system turn"
    assert sf.call(Request.AppendSystem(session, None, [weather])) == Response.Err(
        f"session {session} already has a prompt; AppendSystem must come before any other turn"
    )
    child = sf.call(Request.Fork(session, 2, None)).session
    refused = sf.call(Request.AppendSystem(child, "again", []))
    assert isinstance(refused, Response.Err) and "already has a prompt" in refused.message


def test_everything_survives_a_restart(tmp_path: Path, store: tuple[str, ...]) -> None:
    proc = DaemonProcess(tmp_path, *store).start()
    try:
        params = GenParams(0.7, 0.95, 0.05, 20, 123456789)
        with proc.client() as c:
            root = new_session(c, params)
            say(c, root, "Hello there.")
            generate(c, root, 6)
            c.call(Request.SetMeta(root, 0, "greeting", None))
            child = c.call(Request.Fork(root, 2, None)).session
            before = {s: c.call(Request.Read(s, 0)).events for s in (root, child)}
            tree = c.call(Request.Tree()).nodes
        proc.stop()
        proc.start()
        with proc.client() as c:
            assert c.call(Request.Tree()).nodes == tree
            for s in (root, child):
                c.call(Request.Inspect(s))  # served again: on a shared store, reading alone takes no session
                events = c.call(Request.Read(s, 0)).events
                assert events[: len(before[s])] == before[s] and kinds(events)[len(before[s]) :] == ["EpochBump"]
            inspection = c.call(Request.Inspect(root)).inspection
            assert inspection.params == params and inspection.summary.title == "greeting" and inspection.epoch == 2
            assert c.call(Request.Create(None, params)).session == child + 1, "ids are never reused"
    finally:
        proc.stop()


def test_the_socket_is_private_and_a_stale_one_is_replaced(tmp_path: Path, store: tuple[str, ...]) -> None:
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "sf.sock"))
    stale.close()  # the file stays, as after a kill -9
    proc = DaemonProcess(tmp_path, *store).start()
    try:
        assert (tmp_path / "sf.sock").stat().st_mode & 0o777 == 0o600
        with proc.client() as c:
            assert isinstance(c.call(Request.List()), Response.Sessions)
    finally:
        proc.stop()


def test_subscribe_on_the_socket(tmp_path: Path, store: tuple[str, ...]) -> None:
    proc = DaemonProcess(tmp_path, *store).start()
    try:
        with proc.client() as watcher, proc.client() as writer:
            session = new_session(writer)
            say(writer, session, "Say hello.")
            assert watcher.call(Request.Subscribe(999, 0, False)) == Response.Err("unknown session 999")
            subscribed = watcher.call(Request.Subscribe(session, 1, True))
            assert isinstance(subscribed, Response.Subscribed)
            sub = subscribed.sub
            backlog = watcher.receive()
            assert backlog == Response.SubEvent(sub, writer.call(Request.Read(session, 1)).events[0])
            deltas, _ = forced(writer, session, 6)
            live, provisional = [], ""
            while len(live) < len(deltas) + 2:  # + GenerationFingerprint and GenerationPrompt
                reply = watcher.receive()
                if isinstance(reply, Response.SubEvent):
                    live.append(reply.event)
                elif isinstance(reply, Response.SubProvisional):
                    provisional += reply.text
            # provisional text runs ahead of commits; only a held-back tail (half a marker) can lag
            assert live[2:] == deltas and text_of(deltas).startswith(provisional)
            # another request on the same connection while the subscription is open
            watcher.send(Request.List())
            while not isinstance(reply := watcher.receive(), Response.Sessions):
                assert isinstance(reply, (Response.SubEvent, Response.SubProvisional))
            proc.stop()
            ended = watcher.receive()
            assert ended == Response.SubEnded(sub, "publisher closed")
    finally:
        proc.stop()


def test_complete_is_metered_per_connection(daemon: DaemonProcess) -> None:
    with daemon.client() as first, daemon.client() as second:
        replies = [first.call(Request.Complete("def f(", "", 0, 4)) for _ in range(40)]
        throttled = [r for r in replies if isinstance(r, Response.Throttled)]
        assert throttled and throttled[0].retry_after_ms >= 1
        assert all(isinstance(r, Response.Err) for r in replies[:20])
        assert "no FIM dialect" in replies[0].message
        # another connection has a bucket of its own
        assert isinstance(second.call(Request.Complete("x", "", 0, 4)), Response.Err)


def test_repeated_kills_at_random_moments_lose_nothing(tmp_path: Path, store: tuple[str, ...]) -> None:
    import random

    rng = random.Random(7)
    proc = DaemonProcess(tmp_path, *store).start()
    seen: dict[int, object] = {}
    try:
        with proc.client() as c:
            session = new_session(c, GenParams(0.8, 0.95, 0.0, 40, 5))
            say(c, session, QUESTION)
        for _ in range(3):
            with proc.client() as c:
                c.send(Request.Generate(session, 4000, True))
                deadline = time.monotonic() + rng.uniform(0.3, 1.5)
                while time.monotonic() < deadline:
                    reply = c.receive()
                    assert isinstance(reply, Response.Delta), reply
                    seen[reply.event.event_id] = reply.event
                proc.kill()
            proc.start()
            with proc.client() as c:
                events = {e.event_id: e for e in c.call(Request.Read(session, 0)).events}
                assert all(events[i] == event for i, event in seen.items())
                assert sorted(events) == list(range(len(events)))
    finally:
        proc.stop()
