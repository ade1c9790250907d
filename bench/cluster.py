"""The PostgreSQL store's figures: what sharing one log between daemons costs, and failover.

A PostgreSQL cluster of the bench's own runs in a temporary directory. Against the SQLite
store, at 8 forced streams through the socket, one daemon up at a time (this machine has 2
cores): each tick's commit latency (p50 and p99, from the `superfluid_commit_seconds`
histogram's buckets) and decode tokens/s. Then two daemons on one database with short leases:
the time from a SIGKILL of the one serving a generating session to the other streaming it;
what forwarding a request to the daemon serving its session adds to its first token; and the
first token of a long session taken over after a SIGKILL, from the shared park against a prefill;
and 16 concurrent chats through HAProxy (docs/deployment/haproxy.cfg) over 1, 2 and 3 daemons.
"""

from __future__ import annotations

import functools
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
from loadbalancer import HAProxy
from peer import Superfluid, free_port
from pgcluster import PostgresCluster
from record import Result, median_round

from superfluid.client import SocketClient
from superfluid.protocol.schema import EventBody, GenParams, Request, Response

GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
WINDOW, LANES, STREAMS = 4096, 8, 8
RENEW_S, EXPIRY_S, DEFAULT_EXPIRY_S = 0.5, 3.0, 10.0
COMMIT = "superfluid_commit_seconds"


def buckets(client: SocketClient) -> dict[float, float]:
    """The commit histogram's cumulative bucket counts, by upper bound (inf for +Inf)."""
    text = client.call(Request.Metrics()).text
    pattern = re.compile(rf'^{COMMIT}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} ([-+0-9.eE]+)$', re.MULTILINE)
    counts: dict[float, float] = {}
    for bound, value in pattern.findall(text):
        counts[float(bound)] = counts.get(float(bound), 0.0) + float(value)  # summed over any other labels
    if not counts:
        raise RuntimeError(f"{COMMIT} is not in the daemon's metrics")
    return counts


def quantile(counts: dict[float, float], q: float) -> float:
    """The q-quantile of a cumulative histogram, interpolated linearly within its bucket (as
    Prometheus' histogram_quantile does: one in the +Inf bucket counts as the largest finite bound)."""
    bounds = sorted(counts)
    total = counts[bounds[-1]]
    if total <= 0:
        return float("nan")
    rank, lower, below = q * total, 0.0, 0.0
    for bound in bounds:
        if counts[bound] >= rank:
            if bound == float("inf"):
                return lower
            share = (rank - below) / max(counts[bound] - below, 1e-12)
            return lower + (bound - lower) * share
        lower, below = bound, counts[bound]
    return lower


def fresh_session(client: SocketClient, text: str) -> int:
    session = client.call(Request.Create(None, GREEDY)).session
    reply = client.call(Request.AppendMessage(session, 1, text))
    if not isinstance(reply, Response.Committed):
        raise RuntimeError(f"could not start a session: {reply}")
    return session


def forced(daemon: Superfluid, session: int, tokens: int, into: list[int]) -> None:
    """A generation of exactly `tokens` tokens (end-of-generation banned), on its own connection."""
    with daemon.client() as c:
        c.send(Request.Generate(session, tokens, True))
        reply = c.receive()
        while isinstance(reply, Response.Delta):
            reply = c.receive()
    if not isinstance(reply, Response.Generated):
        raise RuntimeError(f"generation failed: {reply}")
    into.append(reply.tokens_generated)


def concurrently(runs: list[Callable[[list[int]], None]], what: str) -> float:
    """Tokens/s of `runs` started together, each adding the tokens it got to the list it is given."""
    done: list[int] = []
    workers = [threading.Thread(target=run, args=(done,)) for run in runs]
    started = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - started
    if len(done) != len(runs):
        raise RuntimeError(f"{len(runs) - len(done)} of {len(runs)} {what} failed")
    return sum(done) / seconds


def streams(daemon: Superfluid, tokens: int, tag: str) -> float:
    """Tokens/s of STREAMS concurrent forced generations on fresh sessions."""
    with daemon.client() as c:
        sessions = [fresh_session(c, f"Tell me a long story about lighthouse {tag}-{i}.") for i in range(STREAMS)]
    return concurrently([functools.partial(forced, daemon, s, tokens) for s in sessions], "streams")


def daemon(root: Path, threads: int, *extra: str) -> Superfluid:
    """A daemon on the session API only, at the section's sizes."""
    return Superfluid(root, WINDOW, LANES, "--threads", str(threads), *extra, http=False)


class ClusterDaemon(Superfluid):
    """A daemon on `store` with short leases and its --web listener at `web_url` (what other daemons send
    clients to, and forward to)."""

    def __init__(self, root: Path, threads: int, store: str, *extra: str) -> None:
        port = free_port()
        self.web_url = f"http://127.0.0.1:{port}"
        leases = ("--lease-renew", str(RENEW_S), "--lease-expiry", str(EXPIRY_S))
        flags = ("--threads", str(threads), "--store", store, "--web", f"127.0.0.1:{port}", *leases, *extra)
        super().__init__(root, WINDOW, LANES, *flags, http=False)

    def start(self) -> ClusterDaemon:
        super().start()
        return self


def web_first_token(server: ClusterDaemon, session: int) -> float:
    """Seconds from sending a one-token /web/stream to `server` to its first frame (read to its end)."""
    token = (server.socket.parent / "sessions" / "web-token").read_text()
    headers = {"authorization": f"Bearer {token}", "x-superfluid-csrf": token}
    body = {"session": session, "max_tokens": 1, "ignore_eos": True, "provisional": True}
    first = None
    started = time.perf_counter()
    with httpx.stream("POST", f"{server.web_url}/web/stream", json=body, headers=headers, timeout=60) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"/web/stream answered {reply.status_code}: {reply.read()!r}")
        for line in reply.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream ended with no frame")
    return first


def store_round(root: Path, threads: int, store: str | None, tokens: int, tag: str) -> tuple[float, dict[float, float]]:
    """One daemon on `store` (None: SQLite), warmed up, then the workload: (tok/s, bucket deltas)."""
    server = daemon(root, threads, *(("--store", store) if store else ())).start()
    try:
        streams(server, 8, f"warm-{tag}")  # a first run's one-off costs are not steady state
        with server.client() as c:
            before = buckets(c)
            rate = streams(server, tokens, tag)
            after = buckets(c)
    finally:
        server.stop()
    return rate, {bound: after[bound] - before.get(bound, 0.0) for bound in after}


def failover(root: Path, threads: int, store: str, taker: Superfluid, trial: int) -> tuple[float, float]:
    """Seconds from a SIGKILL of the daemon serving a generating session to `taker` streaming it,
    and to the last reply naming the dead daemon (what is left is the takeover and its prefill)."""
    owner = ClusterDaemon(root / f"a-{trial}", threads, store).start()
    try:
        with owner.client() as c:
            session = fresh_session(c, f"Tell me a long story about lighthouse keeper {trial}.")
            c.send(Request.Generate(session, 3000, True))
            seen = 0
            while seen < 8:  # a few tokens streamed: the generation is under way
                reply = c.receive()
                if not isinstance(reply, Response.Delta):
                    raise RuntimeError(f"the owner's generation ended early: {reply}")
                if isinstance(reply.event.body, EventBody.Generated):
                    seen += len(reply.event.body.span)
            assert owner.proc is not None
            owner.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            owner.proc.wait()
    finally:
        owner.stop()
    refused = 0.0
    with taker.client() as c:
        while time.monotonic() - killed < EXPIRY_S + 30:
            c.send(Request.Generate(session, 16, True))
            reply = c.receive()
            if isinstance(reply, Response.Elsewhere):  # the dead owner's lease has not run out yet
                refused = time.monotonic() - killed
                time.sleep(0.05)
                continue
            if not isinstance(reply, Response.Delta):
                raise RuntimeError(f"the other daemon did not take the session: {reply}")
            took = time.monotonic() - killed
            while isinstance(reply, Response.Delta):  # the rest of the stream, so the connection is clean
                reply = c.receive()
            return took, refused
    raise RuntimeError(f"session {session} was still served elsewhere {EXPIRY_S + 30:g} s after the SIGKILL")


def store_rows(root: Path, threads: int, pg: PostgresCluster, tokens: int, rounds: int) -> list[Result]:
    """Commit latency per tick on each store, and decode tok/s on PostgreSQL over SQLite."""
    stores = {"SQLite": None, "PostgreSQL": pg.database()}
    rates: dict[str, list[float]] = {name: [] for name in stores}
    commits: dict[str, dict[float, float]] = {name: {} for name in stores}
    per_round: dict[str, dict[str, list[float]]] = {name: {"p50 ms": [], "p99 ms": []} for name in stores}
    for round_ in range(rounds):
        # one daemon at a time, and who goes first alternates: this machine drifts over minutes
        order = list(stores) if round_ % 2 == 0 else list(reversed(stores))
        for name in order:
            rate, delta = store_round(root / name, threads, stores[name], tokens, f"{round_}")
            rates[name].append(rate)
            per_round[name]["p50 ms"].append(quantile(delta, 0.5) * 1000)
            per_round[name]["p99 ms"].append(quantile(delta, 0.99) * 1000)
            for bound, count in delta.items():
                commits[name][bound] = commits[name].get(bound, 0.0) + count
            print(
                f"cluster: round {round_ + 1} of {rounds}, {name} store: {STREAMS} streams of {tokens} tokens, "
                f"{rate:.1f} tok/s",
                flush=True,
            )
    rows: list[Result] = []
    for name, counts in commits.items():
        workload = f"{counts[float('inf')]:.0f} commits, {STREAMS} streams of {tokens} tokens, {rounds} round(s)"
        for q in (50, 99):
            value = quantile(counts, q / 100) * 1000  # over every round's commits
            key = f"p{q} ms"
            raw = {f"{key}, by round": per_round[name][key]}
            rows.append(
                Result(
                    f"commit per tick, {name} store, p{q} (ms)", value, "(reported)", True, workload, "ms", rounds=raw
                )
            )
    ratios = [a / b for a, b in zip(rates["PostgreSQL"], rates["SQLite"], strict=True)]
    middle = median_round(ratios)
    ratio = ratios[middle]
    detail = (
        f"{rates['PostgreSQL'][middle]:.1f} vs {rates['SQLite'][middle]:.1f} tok/s in the median of {rounds} "
        f"paired round(s) (ratios {', '.join(f'{r:.2f}' for r in ratios)})"
    )
    rows.append(
        Result(
            f"decode tok/s, {STREAMS} streams, PostgreSQL store / SQLite",
            ratio,
            ">= 0.95",
            ratio >= 0.95,
            detail,
            "x",
            "the SQLite store",
            "higher",
            rounds={"PostgreSQL tok/s": rates["PostgreSQL"], "SQLite tok/s": rates["SQLite"], "ratio": ratios},
        )
    )
    return rows


def failover_row(root: Path, threads: int, pg: PostgresCluster, trials: int) -> Result:
    """The median failover time over `trials` owners killed in turn, one taker up throughout."""
    store = pg.database()
    taker = ClusterDaemon(root / "b", threads, store).start()
    try:
        took, refused = [], []
        for trial in range(trials):
            first, last_refusal = failover(root, threads, store, taker, trial)
            took.append(first)
            refused.append(last_refusal)
            print(
                f"cluster: failover {trial + 1} of {trials}: a token after {first:.2f} s "
                f"(sent to the dead daemon until {last_refusal:.2f} s)",
                flush=True,
            )
    finally:
        taker.stop()
    median, limit = float(np.median(took)), EXPIRY_S + 1
    detail = (
        f"bounded by --lease-expiry ({EXPIRY_S:g} s here; {DEFAULT_EXPIRY_S:g} s by default); "
        f"median of {trials}: {', '.join(f'{t:.2f}' for t in took)} s, "
        f"sent to the dead daemon until {', '.join(f'{t:.2f}' for t in refused)} s"
    )
    return Result(
        "failover: SIGKILL of the owner to a token on another daemon (s)",
        median,
        f"<= {limit:g} s",
        median <= limit,
        detail,
        "s",
        rounds={"token after s": took, "sent to the dead daemon until s": refused},
    )


def cluster_figures(root: Path, threads: int, quick: bool, rounds: int | None = None) -> list[Result]:
    """The stores' rows (`rounds` each, by default 1 when quick, else 3), then failover's (as many trials)."""
    rounds = rounds or (1 if quick else 3)
    print("cluster: starting a PostgreSQL cluster", flush=True)
    pg = PostgresCluster()
    try:
        rows = store_rows(root / "cluster", threads, pg, 32 if quick else 128, rounds)
        print(f"cluster: failover, two daemons on one database (--lease-expiry {EXPIRY_S:g})", flush=True)
        rows.append(failover_row(root / "cluster", threads, pg, rounds))
        print("cluster: forwarding to the daemon serving a session", flush=True)
        rows += forwarding_rows(root / "forwarding", threads, pg, 30 if quick else 100)
        print("cluster: a long session taken over, from the shared park and cold", flush=True)
        rows.append(warm_takeover_row(root / "takeover", threads, pg, rounds))
        print("cluster: chats through HAProxy over 1, 2 and 3 daemons", flush=True)
        rows += haproxy_rows(root / "haproxy", threads, pg, rounds)
    finally:
        pg.remove()
    return rows


def forwarding_rows(root: Path, threads: int, pg: PostgresCluster, samples: int) -> list[Result]:
    """First-token time of a one-token generation sent to the daemon serving its session, against the
    same sent to another daemon that forwards it: the difference at p50 and p99, over `samples` each,
    interleaved."""
    store = pg.database()
    owner = ClusterDaemon(root / "owner", threads, store).start()
    other = ClusterDaemon(root / "other", threads, store).start()
    try:
        with owner.client() as c:
            session = fresh_session(c, "Name a colour.")
        direct, forwarded = [], []
        web_first_token(owner, session)  # the first of each pays one-off costs (a connection, the lease)
        web_first_token(other, session)
        for _ in range(samples):
            direct.append(web_first_token(owner, session))
            forwarded.append(web_first_token(other, session))
    finally:
        other.stop()
        owner.stop()
    rows = []
    for q in (50, 99):
        added = (float(np.percentile(forwarded, q)) - float(np.percentile(direct, q))) * 1000
        limit = 5.0 if q == 50 else None
        detail = (
            f"first token of a one-token /web/stream at p{q}: {np.percentile(forwarded, q) * 1000:.1f} ms forwarded, "
            f"{np.percentile(direct, q) * 1000:.1f} ms to the owner, {samples} of each, on loopback"
        )
        rows.append(
            Result(
                f"forwarding: added first-token time, p{q} (ms)",
                added,
                f"<= {limit:g} ms" if limit is not None else "(reported)",
                limit is None or added <= limit,
                detail,
                "ms",
                rounds={"forwarded s": forwarded, "direct s": direct},
            )
        )
    return rows


def takeover_first_token(root: Path, threads: int, store: str, park: str | None, trial: int) -> tuple[float, int]:
    """Seconds to the first token of a long session on the daemon that took it over after its owner's
    SIGKILL (a second after its prefill), both daemons on `park` (None: no park); and its length."""
    flags = ("--park-dir", park) if park else ("--no-park",)
    owner = ClusterDaemon(root / f"owner-{trial}", threads, store, *flags).start()
    taker = ClusterDaemon(root / f"taker-{trial}", threads, store, *flags).start()
    try:
        with owner.client() as c:
            text = " ".join(f"Line {i} of a long document about lighthouse {trial}." for i in range(140))
            session = fresh_session(c, text)
        forced(owner, session, 4, [])
        with owner.client() as c:
            length = len(c.call(Request.Inspect(session)).inspection.tokens)
        time.sleep(1.5)  # a long prompt is parked within a second of its prefill
        assert owner.proc is not None
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait()
        with taker.client() as c:
            deadline = time.monotonic() + EXPIRY_S + 30
            while time.monotonic() < deadline:
                started = time.perf_counter()
                c.send(Request.Generate(session, 4, True))
                reply = c.receive()
                if isinstance(reply, Response.Elsewhere):
                    time.sleep(0.05)
                    continue
                first = time.perf_counter() - started
                while isinstance(reply, Response.Delta):
                    reply = c.receive()
                if not isinstance(reply, Response.Generated):
                    raise RuntimeError(f"the taken-over generation failed: {reply}")
                return first, length
        raise RuntimeError(f"session {session} was not taken over")
    finally:
        taker.stop()
        owner.stop()


def warm_takeover_row(root: Path, threads: int, pg: PostgresCluster, trials: int) -> Result:
    """The first token after a takeover from a shared park over the same without a park (cold)."""
    warm, cold = [], []
    length = 0
    for trial in range(trials):
        first, length = takeover_first_token(root / "warm", threads, pg.database(), str(root / "park"), trial)
        warm.append(first)
        cold.append(takeover_first_token(root / "cold", threads, pg.database(), None, trial)[0])
        print(f"cluster: takeover {trial + 1} of {trials}: first token {warm[-1]:.2f} s warm, {cold[-1]:.2f} s cold")
    ratios = [w / c for w, c in zip(warm, cold, strict=True)]
    middle = median_round(ratios)
    detail = (
        f"a {length:,}-token session taken over after its owner's SIGKILL: {warm[middle]:.2f} s to the first token "
        f"from the shared park (--park-dir) against {cold[middle]:.2f} s prefilling it (ratios "
        f"{', '.join(f'{r:.2f}' for r in ratios)})"
    )
    return Result(
        "takeover after a SIGKILL: first token from the shared park / cold",
        ratios[middle],
        "<= 0.1",
        ratios[middle] <= 0.1,
        detail,
        "x",
        "a cold prefill",
        "lower",
        rounds={"warm s": warm, "cold s": cold, "ratio": ratios},
    )


CHATS, CHAT_TOKENS = 16, 64


def through_haproxy(url: str, tag: str, chats: int = CHATS) -> float:
    """Tokens/s of `chats` concurrent forced chats of CHAT_TOKENS tokens sent to `url`."""

    def chat(i: int, into: list[int]) -> None:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": f"Tell me a story about lighthouse {tag}-{i}."}],
            "max_tokens": CHAT_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
        }
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        reply.raise_for_status()
        into.append(reply.json()["usage"]["completion_tokens"])

    return concurrently([functools.partial(chat, i) for i in range(chats)], "chats")


def haproxy_round(root: Path, threads: int, store: str, daemons: int, tag: str, chats: int = CHATS) -> float:
    """Tokens/s of `chats` chats through HAProxy in front of `daemons` daemons on `store`, sharing this
    machine's `threads` between them, with lanes enough between them to run every chat at once (more
    lanes than one daemon has would be a gain of their own). llama.cpp's threads spin while they wait, so
    two daemons of two threads each on two cores ran 26 times slower than one (6.7 against 174.5 tok/s)."""
    share, lanes = str(max(1, threads // daemons)), -(-chats // daemons)
    servers = [
        Superfluid(root / f"{tag}-{n}", WINDOW, lanes, "--threads", share, "--store", store).start()
        for n in range(daemons)
    ]
    try:
        with HAProxy([f"127.0.0.1:{s.port}" for s in servers], root) as proxy:
            through_haproxy(proxy.url, f"warm-{tag}", chats)  # a first run's one-off costs are not steady state
            return through_haproxy(proxy.url, tag, chats)
    finally:
        for server in servers:
            server.stop()


def haproxy_rows(root: Path, threads: int, pg: PostgresCluster, rounds: int) -> list[Result]:
    """16 concurrent chats through HAProxy over 1, 2 and 3 daemons on this machine, each over one daemon's;
    and what n machines would give: n times one daemon serving its share of the chats on the whole machine."""
    shared: dict[int, list[float]] = {n: [] for n in (1, 2, 3)}
    apart: dict[int, list[float]] = {n: [] for n in (2, 3)}
    for round_ in range(rounds):
        for n in shared:
            shared[n].append(haproxy_round(root, threads, pg.database(), n, f"{round_}-{n}"))
            print(f"cluster: round {round_ + 1} of {rounds}, {n} daemon(s) behind haproxy: {shared[n][-1]:.1f} tok/s")
        for n in apart:
            share = haproxy_round(root, threads, pg.database(), 1, f"{round_}-share-{n}", -(-CHATS // n))
            apart[n].append(n * share)
            print(f"cluster: round {round_ + 1} of {rounds}, one daemon with 1/{n} of the chats: {share:.1f} tok/s")
    rows = []
    for n in (2, 3):
        for rates, name, how in (
            (shared[n], f"chats through HAProxy, {n} daemons on this machine / 1", "on this machine"),
            (apart[n], f"chats through HAProxy, {n} machines (projected) / 1", "projected on machines of their own"),
        ):
            ratios = [many / one for many, one in zip(rates, shared[1], strict=True)]
            middle = median_round(ratios)
            how_measured = (
                f"its {threads} threads shared between them"
                if rates is shared[n]
                else f"{n} times one daemon serving {-(-CHATS // n)} of the chats on the whole machine"
            )
            detail = (
                f"{CHATS} concurrent chats of {CHAT_TOKENS} forced tokens through HAProxy: {rates[middle]:.1f} tok/s "
                f"over {n} daemons {how}, {how_measured}, against {shared[1][middle]:.1f} over one daemon with "
                f"{CHATS} lanes (ratios {', '.join(f'{r:.2f}' for r in ratios)})"
            )
            rows.append(
                Result(
                    name,
                    ratios[middle],
                    "(reported)",
                    True,
                    detail,
                    "x",
                    "one daemon behind HAProxy",
                    "higher",
                    rounds={f"{n} daemons tok/s": rates, "1 daemon tok/s": shared[1], "ratio": ratios},
                )
            )
    return rows
