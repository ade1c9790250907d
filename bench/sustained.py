"""Sustained load: nothing degrades over minutes, and more requests than the KV holds all finish.

- soak: eight clients send short requests back to back for ten minutes (three with --quick);
  the tokens per second of the last minute against the first, the memory of the daemon and its
  workers at the end against after the first minute, and against llama-server's after the same
  soak. Superfluid's host KV tier fills with the evicted prefixes of finished requests up to
  `--host-cache-mb` (a quarter of RAM, at most 2 GiB): that is a cache the flag bounds, not
  growth, so the memory figures leave it out and say how large it was. A fresh daemon then takes
  the same load for a minute: the soak's last minute against it tells a daemon that slowed from a
  machine that did. Two more gauges tell them apart: the tokens superfluid's worker makes per
  second of wall time inside llama.cpp's steps (the same shapes all soak long: a drop there is
  llama.cpp running slower, or other threads and processes taking its cores, not the daemon
  serving it less), and llama-server's own last minute against its first over a soak as long.
- oversubscribed: 32 requests of about 900 prompt tokens and 900 forced output tokens on 8 lanes
  of 2,048 tokens (16 of 450 and 450 on lanes of 1,024 with --quick), all sent at once: every
  one completes, and the wall against llama-server's at the same lanes and context, and against
  llama.cpp's own loop doing the same work (four waves of eight prompts prefilled together, then
  their replies decoded together): how much of llama-server's wall is the work itself.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import load
from peer import LlamaServer, Server, Superfluid, fastest_loop
from record import Result

from superfluid.metrics import read_metric

MINUTE = 60.0
SOAK_TOKENS = 64  # a short reply: the soak is many requests, not long ones


def resident_bytes(pid: int) -> int:
    """The memory a process and every process below it (a daemon and its workers) hold, as their
    proportional set sizes: a page two of them share (the model's mapped file, the host KV tier)
    counts once, split between them, as it takes memory once."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone since the listing
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        todo += children.get(current, [])
        try:
            rollup = Path(f"/proc/{current}/smaps_rollup").read_text()
        except OSError:
            continue
        pss = next((line.split()[1] for line in rollup.splitlines() if line.startswith("Pss:")), "0")
        total += int(pss) * 1024
    return total


@dataclass(frozen=True)
class EngineReading:
    """Superfluid's tokens generated so far, the wall seconds its worker spent inside llama.cpp's
    steps making them and prefilling their prompts, the bytes its host KV tier holds and those of
    the KV states waiting for the park's writer; all 0 for llama-server, which has no such split,
    no tier and no park."""

    tokens: float = 0.0
    compute_seconds: float = 0.0
    tier_bytes: int = 0
    parking_bytes: int = 0


def engine_reading(server: Server) -> EngineReading:
    if not isinstance(server, Superfluid):
        return EngineReading()
    exposition = httpx.get(f"{server.url}/metrics").text
    return EngineReading(
        read_metric(exposition, "superfluid_generated_tokens_total"),
        read_metric(exposition, "superfluid_worker_compute_seconds_total"),
        int(read_metric(exposition, "superfluid_host_cache_bytes")),
        int(read_metric(exposition, "superfluid_park_pending_bytes")),
    )


@dataclass
class Soak:
    """What a soak measured: tokens per second in each minute (by arrival), superfluid's tokens per
    second of llama.cpp compute in the first and the last minute (0 for llama-server), and memory:
    all of it, and the KV states held for reuse (the host tier's, up to --host-cache-mb, and those
    on their way to the park, up to its 64 MiB queue), which fill and empty by design."""

    minutes: list[float]
    compute_first: float
    compute_last: float
    resident_first: int
    tier_first: int
    parking_first: int
    resident_end: int
    tier_end: int
    parking_end: int
    requests: int
    failed: int

    @property
    def first(self) -> float:
        return self.minutes[0]

    @property
    def last(self) -> float:
        return self.minutes[-1]  # before the clients stop sending, not the drain after it

    def rates(self) -> str:
        return ", ".join(f"{rate:.0f}" for rate in self.minutes)

    @property
    def own_first(self) -> int:
        """Memory after the first minute, but the KV states held for reuse."""
        return self.resident_first - self.tier_first - self.parking_first

    @property
    def own_end(self) -> int:
        """Memory at the end, but the KV states held for reuse."""
        return self.resident_end - self.tier_end - self.parking_end


def soak(server: Server, seconds: float, clients: int = 8) -> Soak:
    """`clients` threads sending short chats back to back for `seconds` (whole minutes)."""
    assert server.proc is not None
    started = time.monotonic()
    # when each reply's chunks arrived, and its tokens: a minute's rate counts the tokens that arrived in it,
    # not the replies that ended in it, which come in waves of eight (one wave of 64-token replies is a tenth
    # of a minute's tokens on the 0.7B model)
    done: list[tuple[list[float], int]] = []
    failures: list[str] = []
    lock = threading.Lock()

    def client(index: int) -> None:
        count = 0
        while time.monotonic() - started < seconds:
            note = f"Client {index}, note {count}: say something."
            chat = load.Chat([{"role": "user", "content": note}], SOAK_TOKENS)
            reply = load.send(server.url, chat)
            count += 1
            with lock:
                if reply.error:
                    failures.append(reply.error)
                elif reply.arrivals:
                    done.append((reply.arrivals, reply.completion_tokens))

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    # the engine's counters at the first minute's ends and the last's (the same minute in a one-minute soak)
    readings = {0.0: engine_reading(server)}
    for at in sorted({MINUTE, seconds - MINUTE, seconds}):
        time.sleep(max(0.0, started + at - time.monotonic()))
        readings[at] = engine_reading(server)
        if at == MINUTE:
            resident_first = resident_bytes(server.proc.pid)
    for thread in threads:
        thread.join()
    if failures:
        print(f"  {len(failures)} requests failed, the first: {failures[0]}", flush=True)

    def rate(since: float, until: float) -> float:
        arrived = sum(tokens * sum(since <= at < until for at in arrivals) / len(arrivals) for arrivals, tokens in done)
        return arrived / (until - since)

    def compute_rate(since: float) -> float:
        then, now = readings[since], readings[since + MINUTE]
        seconds = now.compute_seconds - then.compute_seconds
        return (now.tokens - then.tokens) / seconds if seconds > 0 else 0.0

    resident_end, end = resident_bytes(server.proc.pid), engine_reading(server)
    return Soak(
        minutes=[rate(started + m * MINUTE, started + (m + 1) * MINUTE) for m in range(round(seconds / MINUTE))],
        compute_first=compute_rate(0.0),
        compute_last=compute_rate(seconds - MINUTE),
        resident_first=resident_first,
        tier_first=readings[MINUTE].tier_bytes,
        parking_first=readings[MINUTE].parking_bytes,
        resident_end=resident_end,
        tier_end=end.tier_bytes,
        parking_end=end.parking_bytes,
        requests=len(done),
        failed=len(failures),
    )


def oversubscribed(url: str, requests: int, prompt: int, output: int) -> tuple[float, int]:
    """`requests` distinct chats of about `prompt` tokens, each forced to `output` tokens, sent at once:
    the wall until the last finished, and how many completed with every token."""
    chats = [load.Chat([{"role": "user", "content": load.document(7000 + i, prompt)}], output) for i in range(requests)]
    replies, wall = load.timed(lambda: load.together(url, chats))
    return wall, sum(1 for r in replies if r.completion_tokens == output)


def sustained_section(peers: Path | None, quick: bool, threads: int, root: Path, model: Path) -> list[Result]:
    """The soak and the oversubscribed burst, on superfluid and llama-server alike."""
    server_binary = peers / "fast" / "bin" / "llama-server" if peers else None
    peer = server_binary if server_binary is not None and server_binary.exists() else None
    if peer is None:
        print("sustained: llama-server not built (make bench builds it); its figures are left out", flush=True)
    lanes, window = 8, 4096
    served = (str(model), "--threads", str(threads))
    minutes = 3 if quick else 10
    print(f"sustained: superfluid, {minutes} minutes of eight clients", flush=True)
    with Superfluid(root / "soak", window, lanes, *served) as ours:
        mine = soak(ours, minutes * MINUTE)
    print(f"  {mine}", flush=True)
    print("sustained: a fresh superfluid, one minute of the same load", flush=True)
    with Superfluid(root / "soak-fresh", window, lanes, *served) as fresh:
        control = soak(fresh, MINUTE)
    print(f"  {control}", flush=True)
    theirs = None
    if peer is not None:
        print(f"sustained: llama-server, the same {minutes} minutes", flush=True)
        with LlamaServer(peer, model, root / "soak-llama-server", lanes, window, threads) as server:
            theirs = soak(server, minutes * MINUTE)
        print(f"  {theirs}", flush=True)
    mib = 2**20
    growth = mine.own_end / mine.own_first
    share_first, share_last = mine.first / mine.compute_first, mine.last / mine.compute_last
    results = [
        Result(
            "soak, eight clients: tok/s in the last minute / the first",
            mine.last / mine.first,
            ">= 0.95, none failed",
            mine.last / mine.first >= 0.95 and not mine.failed,
            f"{mine.last:.1f} tok/s vs {mine.first:.1f} tok/s; each minute {mine.rates()}; "
            f"{mine.requests} requests, {mine.failed} failed",
            "x",
            "the first minute",
            "higher",
            rounds={"tok/s by minute": mine.minutes},
        ),
        Result(
            "soak: tokens per second of llama.cpp compute in the last minute / the first",
            mine.compute_last / mine.compute_first,
            "(reported)",
            True,
            f"{mine.compute_last:.0f} vs {mine.compute_first:.0f}, the same shapes all soak long, by wall time inside "
            f"llama.cpp's steps (slower kernels, or cores other threads took); "
            f"a fresh daemon right after: {control.compute_first:.0f}",
            "x",
            "the first minute",
            "higher",
            rounds={"soak's first, last; fresh daemon": [mine.compute_first, mine.compute_last, control.compute_first]},
        ),
        Result(
            "soak: tok/s as a share of llama.cpp's compute rate, in the last minute / the first",
            share_last / share_first,
            "(reported)",
            True,
            f"{share_last:.3f} vs {share_first:.3f}: the part of llama.cpp's speed that reached the clients, which "
            "the daemon's own overheads set and the machine's speed does not (a slower machine slows both)",
            "x",
            "the first minute",
            "higher",
            rounds={"share, first and last minute": [share_first, share_last]},
        ),
        Result(
            "soak: tok/s in the last minute / a fresh daemon's first minute right after",
            mine.last / control.first,
            "(reported)",
            True,
            f"{mine.last:.1f} tok/s vs {control.first:.1f} tok/s: the machine's speed then, without the soak's history",
            "x",
            "a fresh daemon",
            "higher",
            rounds={"last minute tok/s": [mine.last], "fresh daemon tok/s": [control.first]},
        ),
        Result(
            "soak: daemon and workers' memory but the KV states cached, at the end / after the first minute",
            growth,
            "<= 1.05",
            growth <= 1.05,
            f"{mine.own_end / mib:.0f} MiB vs {mine.own_first / mib:.0f} MiB; in all "
            f"{mine.resident_end / mib:.0f} MiB vs {mine.resident_first / mib:.0f} MiB, of which the host tier "
            f"{mine.tier_end / mib:.0f} vs {mine.tier_first / mib:.0f} MiB and states queued for the park "
            f"{mine.parking_end / mib:.0f} vs {mine.parking_first / mib:.0f} MiB",
            "x",
            "after the first minute",
            "lower",
            rounds={
                "MiB": [mine.resident_first / mib, mine.resident_end / mib],
                "host tier MiB": [mine.tier_first / mib, mine.tier_end / mib],
                "park queue MiB": [mine.parking_first / mib, mine.parking_end / mib],
            },
        ),
    ]
    if theirs is not None:
        results.append(
            Result(
                "soak, eight clients: tok/s in the first minute / llama-server's",
                mine.first / theirs.first,
                "(reported)",
                True,
                f"{mine.first:.1f} tok/s vs {theirs.first:.1f} tok/s (llama-server: {theirs.failed} "
                "requests cut by its connection handling)",
                "x",
                "llama-server",
                "higher",
                rounds={"superfluid tok/s": [mine.first], "llama-server tok/s": [theirs.first]},
            )
        )
        results.append(
            Result(
                "soak: llama-server's tok/s in its last minute / its first",
                theirs.last / theirs.first,
                "(reported)",
                True,
                f"{theirs.last:.1f} tok/s vs {theirs.first:.1f} tok/s; each minute {theirs.rates()}: the same soak, "
                "another server, on the machine superfluid's ran on",
                "x",
                "its first minute",
                "higher",
                rounds={"tok/s by minute": theirs.minutes},
            )
        )
        over = (mine.own_end - theirs.resident_end) / mib
        results.append(
            Result(
                "soak: memory but the KV states cached, over llama-server's at the same lanes and context (MiB)",
                over,
                "<= 200",
                over <= 200,
                f"{mine.own_end / mib:.0f} MiB (and {mine.tier_end / mib:.0f} MiB of host tier, "
                f"{mine.parking_end / mib:.0f} MiB queued for the park) vs {theirs.resident_end / mib:.0f} MiB",
                "MiB",
                rounds={
                    "superfluid MiB": [mine.resident_end / mib],
                    "superfluid host tier MiB": [mine.tier_end / mib],
                    "superfluid park queue MiB": [mine.parking_end / mib],
                    "llama-server MiB": [theirs.resident_end / mib],
                },
            )
        )
    count, prompt, lane = (16, 450, 1024) if quick else (32, 900, 2048)
    name = f"{count} requests of {prompt}+{prompt} tokens on {lanes} lanes of {lane}"
    systems: dict[str, Callable[[], Server]] = {
        "superfluid": lambda: Superfluid(root / "oversubscribed", lane, lanes, *served),
    }
    if peer is not None:
        systems["llama-server"] = lambda: LlamaServer(peer, model, root / "oversubscribed-peer", lanes, lane, threads)
    walls: dict[str, tuple[float, int]] = {}
    for system, make in systems.items():
        print(f"sustained: {name}, {system}", flush=True)
        with make() as server:
            walls[system] = oversubscribed(server.url, count, prompt, prompt)
        print(f"  wall {walls[system][0]:.1f} s, {walls[system][1]} of {count} complete", flush=True)
    wall, complete = walls["superfluid"]
    results.append(
        Result(
            f"{name}: requests complete",
            complete / count,
            ">= 1.0",
            complete == count,
            f"{complete} of {count}",
            "share",
            rounds={"complete": [complete]},
        )
    )
    if peer is not None:
        loop = fastest_loop(peer.with_name("llama-batched-bench"), model, prompt, prompt, lanes, threads)
        loop_wall = count / lanes * loop["t"]
        print(f"  llama.cpp's loop: {loop_wall:.1f} s for the same work", flush=True)
        peer_wall, peer_complete = walls["llama-server"]
        results.append(
            Result(
                f"{name}: wall / llama-server",
                wall / peer_wall,
                "<= 0.6",
                wall / peer_wall <= 0.6,
                f"{wall:.1f} s vs {peer_wall:.1f} s (llama-server completed {peer_complete} of {count})",
                "x",
                "llama-server",
                "lower",
                f"{count} requests on {lanes} lanes, more than their KV holds: wall",
                rounds={"superfluid s": [wall], "llama-server s": [peer_wall]},
            )
        )
        results.append(
            Result(
                f"{name}: llama.cpp's loop doing the same work / llama-server",
                loop_wall / peer_wall,
                "(reported)",
                True,
                f"{loop_wall:.1f} s vs {peer_wall:.1f} s: {count // lanes} times {lanes} prompts prefilled together "
                f"({loop['t_pp']:.1f} s) and their replies decoded together ({loop['t_tg']:.1f} s), llama.cpp at "
                f"{loop['setting']}; "
                f"superfluid's wall is {wall / loop_wall:.2f} of it",
                "x",
                "llama-server",
                "lower",
                rounds={"llama.cpp loop s": [loop_wall], "llama-server s": [peer_wall]},
            )
        )
    return results
