"""Several daemons on one PostgreSQL store: sessions leased to one daemon at a time, clients sent
to the owner, failover after a SIGKILL, fencing of a paused owner, subscribers across daemons,
and a restart of PostgreSQL under load."""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest
from conftest import (
    CITY,
    GREEDY,
    PostgresCluster,
    WebDaemon,
    chat_body,
    forced,
    free_port,
    generated_tokens,
    metric,
    new_session,
    openai_at,
    say,
    web_stream,
)
from loadbalancer import HAProxy
from openai.types.responses import Response as OpenAIResponse
from superfluid_client import Client

from superfluid.client import SocketClient
from superfluid.protocol.schema import FINISH_ERROR, FINISH_LENGTH, EventBody, Request, Response

pytestmark = pytest.mark.e2e

RENEW_S, EXPIRY_S = 0.5, 3.0
PROMPT = "Tell me about the history of lighthouses."


class ClusterDaemon(WebDaemon):
    """A daemon on `store` with short leases, its session API on --web and the OpenAI routes on --http."""

    def __init__(self, root: Path, store: str, *extra: str) -> None:
        timing = ("--lease-renew", str(RENEW_S), "--lease-expiry", str(EXPIRY_S))
        super().__init__(root, "--store", store, *timing, *extra, max_context=2048)
        self.store = store
        port = free_port()
        self.http_url = f"http://127.0.0.1:{port}"
        self.args = [a for a in self.args if a != "--no-http"] + ["--http", f"127.0.0.1:{port}"]


@pytest.fixture
def daemons(tmp_path: Path, postgres: PostgresCluster) -> Iterator[list[ClusterDaemon]]:
    """Three daemons sharing a fresh database and a park directory."""
    store = postgres.database()
    procs = [ClusterDaemon(tmp_path / name, store, "--park-dir", str(tmp_path / "park")) for name in "abc"]
    threads = [threading.Thread(target=proc.start) for proc in procs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        # the daemons that did start are stopped whatever happens: left running, their workers would count
        # as the next tests' own (they share this process group)
        assert all(proc.alive() for proc in procs)
        yield procs
    finally:
        for proc in procs:
            if proc.proc is not None and proc.proc.poll() is None:
                os.kill(proc.proc.pid, signal.SIGCONT)
            proc.stop()


def started_session(client: SocketClient) -> int:
    session = new_session(client, GREEDY)
    say(client, session, PROMPT)
    return session


def uncut_run(daemon: WebDaemon, tokens: int) -> list[int]:
    """The greedy tokens of a fresh session with PROMPT, run uncut."""
    with daemon.client() as c:
        return generated_tokens(forced(c, started_session(c), tokens)[0])


def read_generation(client: SocketClient, into: list) -> None:
    """Every reply of a Generate already sent, up to its summary."""
    while True:
        into.append(client.receive())
        if not isinstance(into[-1], Response.Delta):
            return


def events_of(daemon: WebDaemon, session: int) -> list:
    with daemon.client() as c:
        reply = c.call(Request.Read(session, 0))
    assert isinstance(reply, Response.Events), reply
    return reply.events


def wait_until_served(daemon: WebDaemon, session: int, timeout: float) -> float:
    """Seconds until `daemon` serves the session rather than naming another daemon."""
    started = time.monotonic()
    with daemon.client() as c:
        while True:
            reply = c.call(Request.Inspect(session))
            if isinstance(reply, Response.Inspection):
                return time.monotonic() - started
            assert isinstance(reply, Response.Elsewhere), reply
            assert time.monotonic() - started < timeout, f"session {session} still served elsewhere"
            time.sleep(0.1)


def test_a_session_is_served_by_one_daemon_and_clients_are_sent_to_it(
    daemons: list[ClusterDaemon], tmp_path: Path
) -> None:
    a, b, _ = daemons
    c_refuses = ClusterDaemon(tmp_path / "d", a.store, "--no-forward").start()
    try:
        assert a.token == b.token, "daemons on one store share the web token, so a client sent on signs in"
        client = Client(a.url, a.token)
        session = client.session()
        session.user("Name a color.")
        first = session.generate(8, ignore_eos=True)
        assert first.tokens == 8

        with c_refuses.client() as c:
            refused = c.call(Request.AppendMessage(session.id, 1, "Another."))
            assert isinstance(refused, Response.Elsewhere) and refused.address == a.url, refused
            read = c.call(Request.Read(session.id, 0))  # reading needs no lease: any daemon answers it
            assert isinstance(read, Response.Events) and read.events == events_of(a, session.id)
            listed = c.call(Request.List())
            assert isinstance(listed, Response.Sessions) and session.id in listed.ids
        inspect = {"Inspect": {"session": session.id}}
        http = httpx.post(f"{c_refuses.url}/web/rpc", json=inspect, headers=c_refuses.headers())
        assert http.status_code == 409 and http.headers["x-superfluid-session-owner"] == a.url, http.text
        forwarded = httpx.post(f"{b.url}/web/rpc", json=inspect, headers=b.headers())  # b asks a, and answers
        assert forwarded.status_code == 200, forwarded.text
        assert forwarded.json()["Inspection"]["inspection"]["summary"]["id"] == session.id

        followed = Client(c_refuses.url, c_refuses.token)
        again = followed.get(session.id)  # sent to a by c, and stays with a from then on
        assert followed.url == a.url
        again.user("And another.")
        assert again.generate(4, ignore_eos=True).tokens == 4
        log = events_of(a, session.id)
        asked = max(i for i, e in enumerate(log) if isinstance(e.body, EventBody.Message))
        assert log[asked].body.text == "And another." and isinstance(log[-1].body, EventBody.Generated)
        chat = chat_body("Name a river.", 12, False)  # a stateless request: whichever daemon gets it answers
        texts = [httpx.post(f"{d.http_url}/v1/chat/completions", json=chat, timeout=60).json() for d in (a, b)]
        assert texts[0]["choices"][0]["message"]["content"] == texts[1]["choices"][0]["message"]["content"]
        assert texts[0]["usage"]["completion_tokens"] == 12
        a.stop()
        assert wait_until_served(b, session.id, 5) < 2.0, "a clean stop gives the leases up: another takes them at once"
    finally:
        c_refuses.stop()


def lanes_active(daemon: ClusterDaemon) -> float:
    with daemon.client() as c:
        return metric(c, "superfluid_lanes_active")


def test_a_request_for_a_session_served_elsewhere_is_answered_by_its_owner(daemons: list[ClusterDaemon]) -> None:
    a, b, _ = daemons
    with a.client() as c:
        session = started_session(c)  # leased to a
    append = {"AppendMessage": {"session": session, "role": 1, "text": "Go on."}}
    rpc = httpx.post(f"{b.url}/web/rpc", json=append, headers=b.headers())
    assert rpc.status_code == 200 and "Committed" in rpc.json(), rpc.text
    hop = httpx.post(f"{b.url}/web/rpc", json=append, headers={**b.headers(), "x-superfluid-forwarded": "x"})
    assert hop.status_code == 409, "a request another daemon sent on is not sent on again: one hop at most"
    body = {"session": session, "max_tokens": 6, "ignore_eos": True}
    frames = web_stream(b, body)
    assert frames[-1]["done"]["tokens_generated"] == 6 and frames[-1]["done"]["finish"] == FINISH_LENGTH
    committed = [f["committed"]["event_id"] for f in frames if "committed" in f]
    log = events_of(a, session)
    assert committed and committed[-1] == log[-1].event_id, "b streamed what a committed"
    # the socket's clients too: b asks a's session API, and answers as a would
    with b.client() as c:
        inspected = c.call(Request.Inspect(session))
        assert isinstance(inspected, Response.Inspection) and inspected.inspection.summary.id == session
        assert isinstance(c.call(Request.AppendMessage(session, 1, "More.")), Response.Committed)
        deltas, summary = forced(c, session, 5)
    assert summary.tokens_generated == 5 and summary.events == deltas
    assert events_of(a, session)[-len(deltas) :] == deltas, "a committed what b's client was sent"
    # b's access log names where it sent them; a line is written once its reply has ended, which a
    # client may see a moment before it
    lines = (
        f"POST /web/stream 200 forwarded_to={a.url} ",
        f"socket Generate ok session={session} forwarded_to={a.url} ",
    )
    deadline = time.monotonic() + 5
    while not all(line in b.log.read_text() for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    access = b.log.read_text()
    assert lines[0] in access, access[-2000:]
    assert lines[1] in access, access[-2000:]

    # a client of b that hangs up frees a's lane
    long = {"session": session, "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", f"{b.url}/web/stream", json=long, headers=b.headers(), timeout=60) as reply:
        assert reply.status_code == 200
        lines = reply.iter_lines()
        while not next(lines).startswith('data: {"committed"'):
            pass
        assert lanes_active(a) == 1
    hung_up = time.monotonic()
    while lanes_active(a) > 0:
        assert time.monotonic() - hung_up < 1.0, "the owner's lane is freed within a second of the hang-up"
        time.sleep(0.05)


def test_a_killed_daemons_sessions_carry_on_elsewhere_as_the_uncut_runs(daemons: list[ClusterDaemon]) -> None:
    a, b, c = daemons
    total = 160
    uncut = uncut_run(c, total)
    seen: dict[int, list] = {}
    clients = [a.client() for _ in range(3)]
    sessions = [started_session(client) for client in clients]
    for client, session in zip(clients, sessions, strict=True):
        client.send(Request.Generate(session, total, True))
        seen[session] = []

    def read_until_cut(client: SocketClient, session: int) -> None:
        try:
            while True:
                reply = client.receive()
                if not isinstance(reply, Response.Delta):
                    return
                seen[session].append(reply.event)
        except (ConnectionError, OSError):
            return

    readers = [threading.Thread(target=read_until_cut, args=pair) for pair in zip(clients, sessions, strict=True)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 60
    while min(len(generated_tokens(events)) for events in seen.values()) < 8:
        assert time.monotonic() < deadline, "no tokens came"
        time.sleep(0.02)
    a.kill()
    killed = time.monotonic()
    for reader in readers:
        reader.join(timeout=30)
    for client in clients:
        client.close()

    waited = wait_until_served(b, sessions[0], EXPIRY_S + 10)
    assert time.monotonic() - killed <= EXPIRY_S + 5, "another daemon serves the session within the lease expiry"
    assert waited > 0
    for session in sessions:
        log = events_of(b, session)
        by_id = {e.event_id: e for e in log}
        assert all(by_id.get(e.event_id) == e for e in seen[session]), "every event a client saw is in the log"
        with b.client() as client:
            so_far = generated_tokens(log)
            rest = generated_tokens(forced(client, session, total - len(so_far))[0]) if len(so_far) < total else []
        assert so_far + rest == uncut, "the cut turn continues on another daemon as the uncut run"
        assert any(isinstance(e.body, EventBody.EpochBump) for e in events_of(b, session)[len(log) - 1 :])
    with b.client() as client:
        assert metric(client, "superfluid_lease_takeovers_total") == len(sessions)
        assert metric(client, "superfluid_leases_held") == len(sessions)


def test_a_paused_owner_past_its_lease_has_its_late_writes_refused(daemons: list[ClusterDaemon]) -> None:
    a, b, _ = daemons
    kept: list = []  # a second session on the paused owner, which nobody takes: it goes on
    with a.client() as owner, a.client() as other:
        session, untaken = started_session(owner), started_session(other)
        other.send(Request.Generate(untaken, 300, True))
        reader = threading.Thread(target=read_generation, args=(other, kept))
        reader.start()
        owner.send(Request.Generate(session, 1500, True))
        seen = []
        while len(generated_tokens(seen)) < 8:
            reply = owner.receive()
            assert isinstance(reply, Response.Delta), reply
            seen.append(reply.event)
        assert a.proc is not None
        os.kill(a.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(EXPIRY_S + 1)
            wait_until_served(b, session, 15)
            with b.client() as taker:
                taken = forced(taker, session, 12)[0]
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        reply = owner.receive()
        while isinstance(reply, Response.Delta):  # what it had committed before it froze
            seen.append(reply.event)
            reply = owner.receive()
        assert isinstance(reply, Response.Generated) and reply.finish == FINISH_ERROR, reply
        reader.join(timeout=120)
    summary = kept[-1]
    assert isinstance(summary, Response.Generated), summary
    assert summary.finish == FINISH_LENGTH and summary.tokens_generated == 300, "the session it kept went on"
    log = events_of(b, session)
    bump = max(i for i, e in enumerate(log) if isinstance(e.body, EventBody.EpochBump))
    after = log[bump + 1 :]
    assert after == taken, "after the takeover the log holds the new owner's events only"
    assert generated_tokens(after) and len(generated_tokens(after)) == 12
    assert after[-1].body.finish == FINISH_LENGTH
    by_id = {e.event_id: e for e in log}
    assert all(by_id.get(e.event_id) == e for e in seen), "what the paused owner's client saw was committed"
    assert all(e.event_id < log[bump].event_id for e in seen)
    with a.client() as c:
        assert metric(c, "superfluid_leases_lost_total") >= 1


def test_a_subscriber_on_one_daemon_sees_every_commit_of_another(daemons: list[ClusterDaemon]) -> None:
    a, b, _ = daemons
    with a.client() as owner, b.client() as watcher:
        session = started_session(owner)
        reply = watcher.call(Request.Subscribe(session, 0, False))
        assert isinstance(reply, Response.Subscribed), reply
        sub = reply.sub
        forced(owner, session, 40)
        say(owner, session, "Thanks.")
        expected = events_of(a, session)
        got = []
        deadline = time.monotonic() + 30
        while len(got) < len(expected):
            assert time.monotonic() < deadline, f"the subscriber saw {len(got)} of {len(expected)} events"
            item = watcher.receive()
            assert isinstance(item, Response.SubEvent) and item.sub == sub, item
            got.append(item.event)
        assert got == expected, "in order, without gaps, as the log holds them"


def test_postgresql_restarted_under_load_loses_nothing(tmp_path: Path) -> None:
    cluster = PostgresCluster()
    try:
        daemon = ClusterDaemon(tmp_path / "a", cluster.url).start()
        try:
            with daemon.client() as c:
                session = started_session(c)
                c.send(Request.Generate(session, 300, True))
                seen, reply = [], c.receive()
                while isinstance(reply, Response.Delta) and len(generated_tokens(seen)) < 8:
                    seen.append(reply.event)
                    reply = c.receive()
                cluster.stop()  # a fast shutdown: every connection is cut
                cluster.start()  # back within the daemon's retries
                while isinstance(reply, Response.Delta):
                    seen.append(reply.event)
                    reply = c.receive()
                assert isinstance(reply, Response.Generated), reply
                assert reply.finish == FINISH_LENGTH, "the daemon waited for the store and went on"
                log = events_of(daemon, session)
                by_id = {e.event_id: e for e in log}
                assert all(by_id.get(e.event_id) == e for e in seen), "every event a client saw is in the log"

                cluster.stop()  # away for longer than the daemon waits: a typed error, nothing written
                refused = c.call(Request.AppendMessage(session, 1, "Still there?"))
                assert isinstance(refused, Response.Err) and "unreachable" in refused.message, refused
                cluster.start()
                assert isinstance(c.call(Request.AppendMessage(session, 1, "Back?")), Response.Committed)
                after = events_of(daemon, session)
                assert after[: len(log)] == log and after[-1].body.text == "Back?"
        finally:
            daemon.stop()
    finally:
        cluster.remove()


def parked_session(daemon: ClusterDaemon) -> tuple[int, int]:
    """A session whose long prompt `daemon` prefilled and has parked (a second later), and its length."""
    with daemon.client() as c:
        session = new_session(c, GREEDY)
        say(c, session, " ".join(f"Line {i} of a long document about lighthouses." for i in range(60)))
        forced(c, session, 4)
        inspection = c.call(Request.Inspect(session)).inspection
    time.sleep(1.0)  # long prompts are parked write-behind, within a second of their prefill
    return session, len(inspection.tokens)


def test_a_session_taken_over_after_a_sigkill_resumes_warm_from_the_shared_park(
    daemons: list[ClusterDaemon], tmp_path: Path
) -> None:
    a, b, c = daemons
    session, prompt = parked_session(a)
    a.kill()
    wait_until_served(b, session, EXPIRY_S + 5)
    with b.client() as client:
        _, summary = forced(client, session, 8)
    assert summary.warm_prefix >= 0.9 * prompt, (summary.warm_prefix, prompt)

    # a parked file cut short is refused, and the session prefilled: nothing is lost
    damaged, _ = parked_session(b)
    for path in (tmp_path / "park").rglob("*.park"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = events_of(b, damaged)
    b.kill()
    wait_until_served(c, damaged, EXPIRY_S + 5)
    with c.client() as client:
        _, summary = forced(client, damaged, 8)
        assert metric(client, "superfluid_park_refused_total") >= 1
    assert summary.warm_prefix == 0 and summary.tokens_generated == 8 and summary.finish == FINISH_LENGTH
    assert events_of(c, damaged)[: len(before)] == before


QUESTION = "Question {}: the capital of France or of Norway? Answer in JSON."


def response_chain(url: str, turns: int, opening: str = "", retries: int = 0) -> list[OpenAIResponse]:
    """Greedy responses that end their turns (CITY), each continuing the one before, sent to `url`: a
    turn cut short would be rendered anew rather than continue its session. `opening` comes before the
    first question; the OpenAI client tries a request `retries` more times on a 503 (after its
    Retry-After) or a lost connection."""
    oa = openai_at(url, max_retries=retries)
    replies: list[OpenAIResponse] = []
    for turn in range(turns):
        replies.append(
            oa.responses.create(
                model="smollm2",
                input=(opening if turn == 0 else "") + QUESTION.format(turn),
                previous_response_id=replies[-1].id if replies else None,
                text={"format": CITY},
                max_output_tokens=32,
                temperature=0,
            )
        )
        assert replies[-1].status == "completed", replies[-1]
    return replies


def behind_haproxy(daemons: list[ClusterDaemon], workdir: Path) -> HAProxy:
    return HAProxy([d.http_url.removeprefix("http://") for d in daemons], workdir).start()


def test_three_daemons_behind_haproxy_need_no_stickiness(daemons: list[ClusterDaemon], tmp_path: Path) -> None:
    a, _, c = daemons
    haproxy = behind_haproxy(daemons, tmp_path)
    url = haproxy.url
    try:
        # a chain of responses whose turns land on every daemon in turn: each is sent on to the daemon
        # serving the chain's session, so it runs as on one daemon, and warm
        through = response_chain(url, 10)
        alone = response_chain(a.http_url, 10)
        assert [r.output_text for r in through] == [r.output_text for r in alone]
        for earlier, later in itertools.pairwise(through):
            assert later.usage.input_tokens_details.cached_tokens >= earlier.usage.total_tokens - 1

        # the session API through it, on a session one daemon serves
        with a.client() as client:
            session = started_session(client)
        headers = a.headers()
        for _ in range(3):  # round robin: at least two of them land elsewhere than a
            frames = web_stream(_Through(url, headers), {"session": session, "max_tokens": 3, "ignore_eos": True})
            assert frames[-1]["done"]["tokens_generated"] == 3
        assert len([e for e in events_of(a, session) if isinstance(e.body, EventBody.Generated)]) >= 3

        # the Anthropic SDK through it: a message carries no session, so it runs where it lands
        claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
        for _ in range(3):
            with claude.messages.stream(
                model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "Name a river."}]
            ) as stream:
                final = stream.get_final_message()
            assert final.usage.output_tokens >= 1 and final.stop_reason in ("end_turn", "max_tokens")

        # a draining daemon leaves the rotation: every request still gets an answer
        assert c.proc is not None
        c.proc.send_signal(signal.SIGUSR1)
        chat = chat_body("Name a river.", 4, False)
        for _ in range(9):
            reply = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
            assert reply.status_code == 200, reply.text
        assert c.proc.wait(30) == 0, "the drained daemon stopped cleanly"
    finally:
        haproxy.stop()


def test_a_chain_through_haproxy_carries_on_warm_after_its_owner_is_killed(
    daemons: list[ClusterDaemon], tmp_path: Path
) -> None:
    # an opening long enough to be parked write-behind as soon as it is prefilled
    opening = " ".join(f"Note {i}: lighthouses guide ships along rocky coasts." for i in range(40)) + "\n"
    haproxy = behind_haproxy(daemons, tmp_path)
    try:
        before = response_chain(haproxy.url, 3, opening)
        # every turn ran on the daemon serving the chain's session, wherever it landed
        ran = [metric_of(d, "superfluid_generations_total") for d in daemons]
        assert sorted(ran) == [0, 0, 3], ran
        owner = daemons[ran.index(3)]
        time.sleep(1.0)  # long prompts are parked write-behind, within a second of their prefill
        owner.kill()

        # the next turn: refused with 503 and Retry-After until the owner's lease runs out, then taken
        # over by another daemon, which resumes the session from the shared park; an unchanged client
        # that honours Retry-After sees one slow reply
        oa = openai_at(haproxy.url, max_retries=10)
        started = time.monotonic()
        after = oa.responses.create(
            model="smollm2",
            input=QUESTION.format(3),
            previous_response_id=before[-1].id,
            text={"format": CITY},
            max_output_tokens=32,
            temperature=0,
        )
        assert time.monotonic() - started < 60, "at most a few tries a second apart past the lease's expiry"
        assert after.usage.input_tokens_details.cached_tokens >= before[0].usage.input_tokens - 1
        # what the client was told before the kill is what the store kept
        for reply in before:
            assert oa.responses.retrieve(reply.id).output_text == reply.output_text
    finally:
        haproxy.stop()

    # the same four turns on one daemon, uncut
    alone = response_chain(next(d for d in daemons if d is not owner).http_url, 4, opening)
    assert [r.output_text for r in [*before, after]] == [r.output_text for r in alone]


def metric_of(daemon: ClusterDaemon, name: str) -> float:
    with daemon.client() as client:
        return metric(client, name)


class _Through:
    """What `web_stream` needs of a daemon, for the load balancer in front of the daemons."""

    def __init__(self, url: str, headers: dict[str, str]) -> None:
        self.url = url
        self._headers = headers

    def headers(self) -> dict[str, str]:
        return self._headers
