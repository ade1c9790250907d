"""Benchmarks: superfluid against llama-server and the bare llama.cpp loop, in one run.

    make bench                                  # builds the peers once (a few minutes), then runs all
    .venv/bin/python bench/run.py --peers DIR   # the same with the peers already built
    .venv/bin/python bench/run.py --quick       # smaller workloads, for a smoke run
    .venv/bin/python bench/run.py --only http   # one section: engine, http, socket, park, startup, spec, ui,
                                                # cluster, agents, engine-large, engine-q4km, engine-q5k,
                                                # http-large, sustained or sustained-large
    .venv/bin/python bench/run.py --rounds 1    # one round of each repeated measure
    .venv/bin/python bench/run.py --only http --model M.gguf --gpu-layers all --results DIR
                                                # the http section on a GGUF of one's own, on a GPU
                                                # (scripts/gpu_check.sh), its figures kept apart
    .venv/bin/python bench/render.py            # docs/benchmarks.md and the README's summary, from the results

Fifteen sections, one system driven at a time:
- engine: llama.cpp's own `llama-batched-bench` at llama.cpp's defaults (its fastest build,
  flash attention as llama.cpp chooses, one unified KV), with flash attention on a KV stream
  per sequence, at superfluid's two settings (`--kernels exact`, the default, and `--kernels
  fast`: llama.cpp's build with our patches, flash attention, a KV stream per sequence; exact
  holds flash attention to one order and repacks only the weights whose kernels ignore the
  batch) and on the wheel's build, which exact kernels run on where that build is missing;
- http: superfluid (default kernels, and `--kernels fast` for the agents) and llama-server
  (built from the same llama.cpp, `-np 8 -kvu`) driven over OpenAI HTTP by the same client:
  idle first token, decode at 1 and 8 streams and a burst sharing a system prompt (both
  systems up, taking turns), then eight agents with a chat arriving behind them, and the
  floor under their wall and first-token median (one agent alone on the idle server: eight
  such prompts prefilled back to back, then their replies decoded together by llama.cpp's loop);
- socket: the session API against a bare llama.cpp loop in this process (the exact build,
  and the daemon on `--kernels exact`): decode, forks, shared prefixes, a chat behind
  agents, memory inside its flags;
- park: a 2,000-token session's next first token after a SIGKILL, after a clean stop and
  after its worker's SIGKILL (its KV parked on disk), against a cold prefill of it; and 200
  idle 1,000-token sessions on slots for 20, resumed oldest first from the park;
- startup: a daemon killed with SIGKILL serving again, on an empty log and on 10,000 sessions
  and a million events (bench/startup.py);
- spec: speculative decoding (`--speculate prompt-lookup` and `auto`) against none, rewriting a
  module and chatting, at 1, 4 and 8 streams (bench/spec.py);
- ui: the browser UI in headless Chromium: the first paint of a 1,000-event session, and how
  soon a streamed reply's committed tokens reach the page (bench/ui.py);
- cluster: the PostgreSQL store against SQLite (commit latency per tick, decode at 8 streams),
  failover to another daemon after a SIGKILL, what forwarding to the daemon serving a session
  adds to its first token, and a long session's takeover from the shared park against a cold
  prefill (bench/cluster.py);
- agents: a Claude Code turn's first token, cold and warm (a second turn with the same system
  prompt and tools), on superfluid and llama-server (bench/agents.py);
- engine-large, http-large: the engine and http sections again on a random-weight model of the embedded one's
  architecture at about 0.7B parameters (bench/random_model.py writes it once, with llama.cpp's
  gguf-py, and caches it), where decoding is bound by memory bandwidth as on the models people
  run; every request there uses `ignore_eos`, since its text is noise;
- engine-q4km, engine-q5k: the engine section on that model with K-quant weights drawn as random
  blocks: Q4_K_M's mix (Q4_K, which llama.cpp repacks, and Q6_K, which its tiled kernels take
  from eight rows on) and Q5_K (tiled too); exact kernels keep both kernels where their
  one-token kernels sum alike;
- sustained, sustained-large: ten minutes of eight clients (tokens per second and resident
  memory, first minute against last, and memory against llama-server's), and 32 requests of
  900+900 tokens on 8 lanes of 2,048 against llama-server (bench/sustained.py), on each model.
Each section that measured something writes bench/results/SECTION.json (bench/record.py: the
machine, the commit, the date, the settings, and per figure its median, unit, baseline, target
and every round's raw values); bench/render.py renders docs/benchmarks.md and the README's
summary table from those files. Performance claims come from this script, not from tests.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import llama_cpp as L
import load
import numpy as np
from agents import agent_figures
from cluster import cluster_figures
from peer import LLAMA_CPP_DEFAULTS, LLAMA_CPP_FLASH, LlamaServer, Superfluid, batched_bench, fastest_loop, median_row
from random_model import Shape, random_model
from record import RESULTS, SECTIONS, Result, median_round, save
from spec import spec_figures
from startup import startup_figures
from sustained import sustained_section
from ui import ui_figures

from superfluid.client import SocketClient
from superfluid.engine.build import worker_environment
from superfluid.engine.interface import ContextShape
from superfluid.engine.llama import LlamaContext, LlamaModel
from superfluid.metrics import read_metric
from superfluid.model.resolve import embedded_model
from superfluid.protocol.schema import GenParams, Request, Response

GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
OPENER = "<|im_start|>assistant\n"


class RawLoop:
    """The bare llama.cpp loop: decode, argmax, decode again; one llama_batch, numpy for the argmax."""

    def __init__(self, model: LlamaModel, window: int, sequences: int, threads: int) -> None:
        self.model = model
        self.context = LlamaContext(model, ContextShape(window, sequences, 512, threads))
        self.mem = L.llama_get_memory(self.context._ctx)
        self.batch = L.llama_batch_init(512, 0, 1)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> np.ndarray:
        batch = self.batch
        batch.n_tokens = len(items)
        for i, (token, pos, seq, want) in enumerate(items):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = want
        if L.llama_decode(self.context._ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(1 for item in items if item[3])
        return np.ctypeslib.as_array(L.llama_get_logits(self.context._ctx), shape=(rows, self.model.n_vocab))

    def clear(self) -> None:
        L.llama_memory_clear(self.mem, True)

    def prefill(self, seq: int, tokens: list[int], chunk: int = 256) -> np.ndarray:
        last = None
        for start in range(0, len(tokens), chunk):
            part = tokens[start : start + chunk]
            items = [(t, start + i, seq, start + i == len(tokens) - 1) for i, t in enumerate(part)]
            rows = self._decode(items)
            if len(rows):
                last = rows[-1].copy()
        assert last is not None
        return last

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
        """Greedy generation on len(prompts) sequences in one batch; (tokens, seconds)."""
        self.clear()
        started = time.perf_counter()
        logits = [self.prefill(seq, p) for seq, p in enumerate(prompts)]
        positions = [len(p) for p in prompts]
        alive = set(range(len(prompts)))
        counts = [0] * len(prompts)
        while alive:
            items = []
            for seq in sorted(alive):
                token = int(np.argmax(logits[seq]))
                if self.model.end_of_generation[token] or counts[seq] >= max_tokens:
                    alive.discard(seq)
                    continue
                counts[seq] += 1
                if counts[seq] >= max_tokens:
                    alive.discard(seq)
                    continue
                items.append((token, positions[seq], seq, True))
                positions[seq] += 1
            if not items:
                break
            rows = self._decode(items)
            for row, (_, _, seq, _) in enumerate(items):
                logits[seq] = rows[row]
        return sum(counts), time.perf_counter() - started


def session_with(client: SocketClient, tokens: list[int], qos: int | None = None) -> int:
    session = client.call(Request.Create(None, GREEDY)).session
    if qos is not None:
        client.call(Request.SetQos(session, qos, False))
    client.call(Request.Append(session, None, tokens))
    return session


def timed_generate(client: SocketClient, session: int, max_tokens: int) -> tuple[float, float, Response.Generated]:
    """(seconds to the first committed token, seconds in all, summary)."""
    started = time.perf_counter()
    first = None
    for reply in client.generate(session, max_tokens):
        if first is None and isinstance(reply, Response.Delta):
            first = time.perf_counter() - started
    if not isinstance(reply, Response.Generated):
        raise RuntimeError(f"generation failed: {reply}")
    return first if first is not None else time.perf_counter() - started, time.perf_counter() - started, reply


def generate_on_own_connection(daemon: Superfluid, session: int, max_tokens: int) -> Response.Generated:
    with daemon.client() as own:
        return timed_generate(own, session, max_tokens)[2]


def collect(into: list[Response.Generated], daemon: Superfluid, session: int, max_tokens: int) -> None:
    into.append(generate_on_own_connection(daemon, session, max_tokens))


def metric(client: SocketClient, name: str) -> float:
    return read_metric(client.call(Request.Metrics()).text, name)


def prompt(model: LlamaModel, text: str) -> list[int]:
    return model.tokenize(f"<|im_start|>user\n{text}<|im_end|>\n{OPENER}", True)


def filler(model: LlamaModel, tokens: int, seed: int) -> str:
    """Text of about `tokens` tokens, different for each seed."""
    words = ["harbour", "lamp", "keeper", "storm", "ledger", "granite", "tide", "signal", "rope", "gull"]
    rng = np.random.default_rng(seed)
    text = " ".join(rng.choice(words, size=tokens))
    return model.detokenize(model.tokenize(text, False)[:tokens])


def socket_section(
    quick: bool, root: Path, fastest: dict[int, float], threads: int, rounds: int | None = None
) -> list[Result]:
    window, lanes = 4096, 8
    decode_tokens = 64 if quick else 192
    rounds = rounds or (3 if quick else 7)
    fork_tokens = 800 if quick else 2000
    shared_tokens = 500 if quick else 1500
    burst = 8 if quick else 16
    agent_tokens = 500 if quick else 1500
    model = LlamaModel(embedded_model().path)
    results: list[Result] = []

    raw = RawLoop(model, window, lanes + 4, threads)
    document = prompt(model, filler(model, fork_tokens, 1))
    raw.clear()
    started = time.perf_counter()
    raw.prefill(0, document)
    cold_prefill = time.perf_counter() - started

    host_cache_mb = 512
    # the raw loop runs in this process, on the exact build llama-cpp-python loads: the daemon does too
    flags = ("--host-cache-mb", str(host_cache_mb), "--threads", str(threads), "--kernels", "exact")
    daemon = Superfluid(root / "socket", window, lanes, *flags).start()
    try:
        with daemon.client() as c:
            # 1. decode throughput at 1 and 8 concurrent sessions: the raw loop runs before and
            # after the daemon on prompts neither has seen; each round's ratio compares runs seconds
            # apart, and the median round counts (this machine's speed drifts by 10-20% over minutes)
            channel_before = (
                metric(c, "superfluid_worker_step_seconds_total"),
                metric(c, "superfluid_worker_compute_seconds_total"),
            )
            for n in (1, 8):
                raw_rates, rates, ratios = [], [], []
                for round_ in range(rounds):
                    stories = [
                        prompt(model, f"Tell me a long story about lighthouse {round_}-{n}-{i}.") for i in range(n)
                    ]
                    tokens, seconds = raw.generate(stories, decode_tokens)
                    before = tokens / seconds
                    sessions = [session_with(c, story) for story in stories]
                    done: list[Response.Generated] = []
                    started = time.perf_counter()
                    workers = [
                        threading.Thread(target=collect, args=(done, daemon, s, decode_tokens)) for s in sessions
                    ]
                    for w in workers:
                        w.start()
                    for w in workers:
                        w.join()
                    rates.append(sum(r.tokens_generated for r in done) / (time.perf_counter() - started))
                    tokens, seconds = raw.generate(stories, decode_tokens)  # raw runs before and after: drift cancels
                    raw_rates.append((before + tokens / seconds) / 2)
                    ratios.append(rates[-1] / raw_rates[-1])
                middle = median_round(ratios)
                ratio = ratios[middle]
                results.append(
                    Result(
                        f"decode tok/s through the socket, {n} session(s) / raw loop, same engine",
                        ratio,
                        ">= 0.95",
                        ratio >= 0.95,
                        f"{rates[middle]:.1f} vs {raw_rates[middle]:.1f} tok/s, the median of {rounds} paired rounds",
                        "x",
                        "the raw llama.cpp loop, --kernels exact",
                        "higher",
                        rounds={"superfluid tok/s": rates, "raw loop tok/s": raw_rates, "ratio": ratios},
                    )
                )
                if n in fastest:
                    best = float(np.median(rates)) / fastest[n]
                    results.append(
                        Result(
                            f"decode tok/s through the socket, {n} session(s) / fastest llama.cpp loop",
                            best,
                            ">= 0.95",
                            best >= 0.95,
                            f"{np.median(rates):.1f} vs {fastest[n]:.1f} tok/s (llama-batched-bench)",
                            "x",
                            "the fastest llama-batched-bench setting",
                            "higher",
                            rounds={"superfluid tok/s": rates, "llama-batched-bench tok/s": [fastest[n]]},
                        )
                    )
            del raw
            step = metric(c, "superfluid_worker_step_seconds_total") - channel_before[0]
            compute = metric(c, "superfluid_worker_compute_seconds_total") - channel_before[1]
            overhead = (step - compute) / max(step, 1e-9)
            results.append(
                Result(
                    "worker channel: share of each decode step spent outside llama.cpp's worker",
                    overhead,
                    "<= 0.02",
                    overhead <= 0.02,
                    f"{step - compute:.3f} s of {step:.2f} s of steps, over the decode rounds above",
                    "share",
                    rounds={"step s": [step], "compute s": [compute]},
                )
            )

            # 2. first token of a fork of a long session, against a cold prefill of it
            parent = session_with(c, document)
            timed_generate(c, parent, 1)
            parent_len = len(c.call(Request.Inspect(parent)).inspection.tokens)
            head = len(c.call(Request.Read(parent, 0)).events)
            fork = c.call(Request.Fork(parent, head, None)).session
            c.call(Request.AppendMessage(fork, 1, "Summarise it in one line."))
            ttft, _, summary = timed_generate(c, fork, 4)
            ratio = ttft / cold_prefill
            warm = summary.warm_prefix / parent_len
            results.append(
                Result(
                    f"fork of a {parent_len}-token session: first token / cold prefill",
                    ratio,
                    "<= 0.10, warm >= 90%",
                    ratio <= 0.10 and warm >= 0.9,
                    f"{ttft:.3f}s vs {cold_prefill:.2f}s, warm_prefix {summary.warm_prefix} ({warm:.0%})",
                    "x",
                    "a cold prefill (raw llama.cpp loop)",
                    "lower",
                    f"first token of a fork of a {parent_len}-token session",
                    {"first token s": [ttft], "cold prefill s": [cold_prefill], "warm prefix": [summary.warm_prefix]},
                )
            )

            # 3. a burst sharing one long prefix
            prefix = filler(model, shared_tokens, 2)
            prefix_len = len(model.tokenize(prefix, False))
            burst_sessions = [
                session_with(c, prompt(model, f"{prefix}\nQuestion {i}: what is word {i}?")) for i in range(burst)
            ]
            before = metric(c, "superfluid_prefill_tokens_total")
            workers = [threading.Thread(target=generate_on_own_connection, args=(daemon, s, 4)) for s in burst_sessions]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            prefilled = metric(c, "superfluid_prefill_tokens_total") - before
            ratio = prefilled / prefix_len
            results.append(
                Result(
                    f"{burst} requests sharing a {prefix_len}-token prefix: tokens prefilled / prefix",
                    ratio,
                    "<= 2",
                    ratio <= 2,
                    f"{prefilled:.0f} tokens prefilled",
                    "x",
                    "the shared prefix's tokens",
                    rounds={"tokens prefilled": [prefilled], "prefix tokens": [prefix_len]},
                )
            )

            # 4. an interactive chat behind eight agents prefilling long prompts
            agents = [session_with(c, prompt(model, filler(model, agent_tokens, 10 + i)), qos=2) for i in range(8)]
            agent_results: list[Response.Generated] = []
            workers = [threading.Thread(target=collect, args=(agent_results, daemon, s, 32)) for s in agents]
            for w in workers:
                w.start()
            time.sleep(2.0)
            chat = session_with(c, prompt(model, "Hi! Say hello."), qos=0)
            chat_ttft, _, _ = timed_generate(c, chat, 8)
            for w in workers:
                w.join()
            complete = len(agent_results) == 8  # every agent got its summary (an agent may stop at once)
            results.append(
                Result(
                    f"chat first token behind 8 agents prefilling {agent_tokens}-token prompts (s)",
                    chat_ttft,
                    "<= 1.0 s, agents complete",
                    chat_ttft <= 1.0 and complete,
                    f"{len(agent_results)}/8 agents completed, preemptions "
                    f"{metric(c, 'superfluid_preemptions_total'):.0f}",
                    "s",
                    rounds={"chat first token s": [chat_ttft], "agents completed": [len(agent_results)]},
                )
            )

            # 5. memory stays inside its flags
            slots = metric(c, "superfluid_kv_slots")
            slot_tokens = metric(c, "superfluid_kv_slot_tokens")
            host = metric(c, "superfluid_host_cache_bytes")
            budget = metric(c, "superfluid_host_cache_budget_bytes")
            within = slot_tokens == window and slots == lanes + 4 and host <= budget == host_cache_mb << 20
            results.append(
                Result(
                    "KV pool and host cache inside their flags",
                    host / max(budget, 1),
                    "host <= budget",
                    within,
                    f"{slots:.0f} slots x {slot_tokens:.0f} tokens; host cache {host / 2**20:.0f} of "
                    f"{budget / 2**20:.0f} MiB",
                    "share",
                    rounds={
                        "slots": [slots],
                        "slot tokens": [slot_tokens],
                        "host bytes": [host],
                        "budget bytes": [budget],
                    },
                )
            )
    finally:
        daemon.stop()
    return results


# ---- engine: llama.cpp's own loop, at its defaults and at superfluid's settings ----

# the first is llama.cpp's defaults, then flash attention alone, then superfluid's two settings on the
# fast build, then the wheel's build, which exact kernels run on where the fast build is not installed.
# Each is (name, build, flags, kernels): kernels None runs llama.cpp's own switches, "fast" or "exact" those a
# superfluid worker on that build runs with (on the wheel's, which the `exact` build stands for, tiled kernels off).
ENGINE_CONFIGS: tuple[tuple[str, str, tuple[str, ...], str | None], ...] = (
    ("llama.cpp defaults: its build, flash attention auto, unified KV", "fast", LLAMA_CPP_DEFAULTS, None),
    ("llama.cpp build, flash attention, a KV stream per sequence", "fast", LLAMA_CPP_FLASH, None),
    ("superfluid --kernels fast: llama.cpp build, flash attention, a KV stream per sequence", "fast", LLAMA_CPP_FLASH,
     "fast"),
    (
        "superfluid --kernels exact: llama.cpp build, only Q4_0, IQ4_NL and Q4_K weights repacked, tiled kernels "
        "for all but IQ1 weights, flash attention in one order, a KV stream per sequence",
        "fast",
        LLAMA_CPP_FLASH,
        "exact",
    ),
    ("the wheel's build (exact without the fast build), no flash attention, a KV stream per sequence", "exact",
     ("-fa", "off"), "exact"),
)  # fmt: skip
# what superfluid runs: its two kernel settings, each against the fastest of llama.cpp's own settings
OUR_ENGINES = {"fast": ENGINE_CONFIGS[2][0], "exact": ENGINE_CONFIGS[3][0]}
LLAMA_CPP_SETTINGS = (ENGINE_CONFIGS[0][0], ENGINE_CONFIGS[1][0])
HEADLINE_PROMPT = 1500  # the prompt whose prefill the README's summary shows
# A 100-token prompt prefills in a quarter to one and a half seconds, which one run measures within a few
# percent either way; so a configuration runs it SHORT_REPEATS times a round and counts the median.
SHORT_REPEATS = 3


def repeats(prompt: int) -> int:
    """How many times a round runs a one-sequence prefill of `prompt` tokens."""
    return SHORT_REPEATS if prompt < HEADLINE_PROMPT else 1


def engine_section(
    peers: Path, quick: bool, threads: int, model: Path | None = None, rounds: int = 1
) -> tuple[list[Result], dict[int, float]]:
    """Prefill and decode of each configuration, on `model` (the embedded one when None), the configurations
    taking turns `rounds` times and each figure the median of its rounds; returns the results and the fastest
    decode per stream count."""
    model = model or embedded_model().path
    prompts = (100, HEADLINE_PROMPT) if quick else (100, HEADLINE_PROMPT, 4000)
    tokens = 64 if quick else 128
    measured: dict[str, list[list[dict]]] = {name: [] for name, *_ in ENGINE_CONFIGS}
    for turn in range(rounds):
        # each round starts one configuration later, so that none always runs first or last (this machine's
        # speed drifts within a round as much as between settings)
        start = turn % len(ENGINE_CONFIGS)
        for name, build, flags, kernels in ENGINE_CONFIGS[start:] + ENGINE_CONFIGS[:start]:
            binary = peers / build / "bin" / "llama-batched-bench"
            library = binary.parent if build == "fast" else None
            environment = {} if kernels is None else worker_environment(library, exact=kernels == "exact")
            args = ("-t", str(threads), *flags)
            runs = [
                batched_bench(binary, model, p, tokens, [1], *args, environment=environment, repeats=repeats(p))
                for p in prompts
            ]
            runs.append(batched_bench(binary, model, prompts[0], tokens, [8], *args, environment=environment))
            if not quick:
                runs.append(batched_bench(binary, model, prompts[1], tokens, [8], *args, environment=environment))
            measured[name].append([row for run in runs for row in run])
            print(f"engine, round {turn + 1} of {rounds}: {name}", flush=True)
            for row in measured[name][-1]:
                print(
                    f"  prompt {row['pp']:5d} x{row['pl']}: prefill {row['speed_pp']:7.1f} tok/s, "
                    f"decode {row['speed_tg']:6.1f} tok/s",
                    flush=True,
                )
    rows = {name: [median_row(same) for same in zip(*turns, strict=True)] for name, turns in measured.items()}
    fastest = {
        n: max(
            r["speed_tg"]
            for name, build, _, _ in ENGINE_CONFIGS
            if build == "fast"
            for r in rows[name]
            if r["pl"] == n and r["pp"] == 100
        )
        for n in (1, 8)
    }
    results = []
    for kernels, name in OUR_ENGINES.items():
        for index, mine in enumerate(rows[name]):
            for phase in ("pp", "tg"):
                what, key = ("prefill" if phase == "pp" else "decode"), f"speed_{phase}"
                # the baseline is whichever of llama.cpp's own settings was fastest at this row
                best = max(LLAMA_CPP_SETTINGS, key=lambda setting: rows[setting][index][key])
                ours, theirs = mine[key], rows[best][index][key]
                headline = ""
                if (kernels, phase, mine["pl"], mine["pp"]) == ("exact", "pp", 1, HEADLINE_PROMPT):
                    headline = f"prefill of a {HEADLINE_PROMPT:,}-token prompt, the engine under superfluid"
                results.append(
                    Result(
                        f"engine {what}, prompt {mine['pp']} x{mine['pl']}: --kernels {kernels} / llama.cpp's fastest",
                        ours / theirs,
                        "(our settings)",
                        True,
                        f"{ours:.1f} vs {theirs:.1f} tok/s, medians of {rounds} (llama.cpp: {best.split(':')[0]})",
                        "x",
                        "llama.cpp's fastest setting (llama-batched-bench)",
                        "higher",
                        headline,
                        {
                            f"--kernels {kernels} tok/s": [t[index][key] for t in measured[name]],
                            "llama.cpp's fastest tok/s": [t[index][key] for t in measured[best]],
                        },
                    )
                )
    return results, fastest


# ---- park: a session warm again after a restart ----

PARK_SESSION = 2000


def first_token_after_start(daemon: Superfluid, session: int) -> tuple[float, Response.Generated]:
    """Start `daemon`, then time the first token of a 4-token generation on `session`."""
    daemon.start()
    with daemon.client() as c:
        ttft, _, summary = timed_generate(c, session, 4)
    return ttft, summary


def park_section(root: Path, threads: int, quick: bool) -> list[Result]:
    """A long session's next first token after a SIGKILL, a clean stop and a worker respawn, against
    a cold prefill; then many idle sessions, more than the slots hold, resumed from the park."""
    model = LlamaModel(embedded_model().path)
    flags = ("--threads", str(threads))
    warm = Superfluid(root / "park", 4096, 8, *flags).start()
    with warm.client() as c:
        session = session_with(c, prompt(model, filler(model, PARK_SESSION, 5)))
        timed_generate(c, session, 4)
        length = len(c.call(Request.Inspect(session)).inspection.tokens)
    parks(warm, 1, within=60)
    assert warm.proc is not None
    warm.proc.kill()
    warm.proc.wait()
    shutil.copytree(root / "park" / "sessions", root / "cold" / "sessions")
    killed, after_kill = first_token_after_start(warm, session)
    warm.stop()
    stopped, after_stop = first_token_after_start(warm, session)
    respawned, after_respawn = first_token_after_worker_kill(warm, session)
    warm.stop()
    cold = Superfluid(root / "cold", 4096, 8, *flags, "--no-park")
    prefill, _ = first_token_after_start(cold, session)
    cold.stop()
    print(
        f"park: {length} tokens; first token after SIGKILL {killed:.3f} s, after a clean stop {stopped:.3f} s, "
        f"after a worker's SIGKILL {respawned:.3f} s, cold prefill {prefill:.2f} s",
        flush=True,
    )
    results = [
        Result(
            f"{label}: first token of a {length}-token session / cold prefill",
            seconds / prefill,
            "<= 0.10, warm >= 90%",
            seconds / prefill <= 0.10 and summary.warm_prefix >= 0.9 * length,
            f"{seconds:.3f} s vs {prefill:.2f} s, warm_prefix {summary.warm_prefix}",
            "x",
            "a cold prefill of the session",
            "lower",
            f"first token of a {length}-token session after a SIGKILL" if label == "after a SIGKILL" else "",
            {"first token s": [seconds], "cold prefill s": [prefill], "warm prefix": [summary.warm_prefix]},
        )
        for label, seconds, summary in (
            ("after a SIGKILL", killed, after_kill),
            ("after a clean stop", stopped, after_stop),
            ("after a worker respawn", respawned, after_respawn),
        )
    ]
    return [*results, many_idle_sessions(root, threads, 40 if quick else 200)]


def parks(daemon: Superfluid, at_least: float, within: float = 120.0) -> float:
    """superfluid_parks_total once it reaches `at_least`, or after `within` seconds."""
    deadline = time.monotonic() + within
    with daemon.client() as c:
        while (parked := metric(c, "superfluid_parks_total")) < at_least and time.monotonic() < deadline:
            time.sleep(0.2)
    return parked


def first_token_after_worker_kill(daemon: Superfluid, session: int) -> tuple[float, Response.Generated]:
    """Once `session` is parked again, SIGKILL the daemon's worker; time the first token after its respawn."""
    parks(daemon, 1)
    assert daemon.proc is not None
    worker = ["pgrep", "-P", str(daemon.proc.pid), "-f", "superfluid-worker-llamacpp"]
    os.kill(int(subprocess.run(worker, capture_output=True).stdout.split()[0]), signal.SIGKILL)
    with daemon.client() as c:
        deadline = time.monotonic() + 120
        while metric(c, "superfluid_worker_respawns_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        ttft, _, summary = timed_generate(c, session, 4)
    return ttft, summary


def many_idle_sessions(root: Path, threads: int, count: int) -> Result:
    """`count` sessions of about 1,000 tokens on a daemon with slots for 20 and no host memory:
    resumed oldest first once all are idle, each should come back warm from the park."""
    model = LlamaModel(embedded_model().path, vocab_only=True)
    lanes = 16  # and 4 spare slots: 20
    daemon = Superfluid(root / "many", 2048, lanes, "--threads", str(threads), "--host-cache-mb", "0").start()
    try:
        with daemon.client() as c:
            sessions = [session_with(c, prompt(model, filler(model, 1000, 100 + i))) for i in range(count)]
            for start in range(0, count, lanes):
                done: list[Response.Generated] = []
                workers = [
                    threading.Thread(target=collect, args=(done, daemon, s, 1)) for s in sessions[start : start + lanes]
                ]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join()
                print(f"park: {start + len(workers)} of {count} sessions prefilled", flush=True)
            length = len(c.call(Request.Inspect(sessions[-1])).inspection.tokens)
            parked = parks(daemon, count, within=600)
            resumed = [timed_generate(c, s, 1) for s in sessions]
            cold = timed_generate(c, session_with(c, prompt(model, filler(model, 1000, 99))), 1)[0]
    finally:
        daemon.stop()
    warm = [ttft for ttft, _, summary in resumed if summary.warm_prefix >= 0.9 * length]
    last_warm = resumed[-1][2].warm_prefix >= 0.9 * length
    detail = (
        f"{len(warm)} of {count} warm (the last: {'yes' if last_warm else 'no'}), {parked:.0f} parked; "
        f"first token p50 {np.median([r[0] for r in resumed]):.3f} s vs a cold prefill {cold:.2f} s"
    )
    print(f"park: {detail}", flush=True)
    return Result(
        f"{count} idle {length}-token sessions, slots for 20: share resumed warm from the park",
        len(warm) / count,
        "the last one warm",
        last_warm,
        detail,
        "share",
        rounds={
            "first token s": [r[0] for r in resumed],
            "warm prefix": [r[2].warm_prefix for r in resumed],
            "cold prefill s": [cold],
            "parked": [parked],
        },
    )


# ---- http: superfluid and llama-server, driven alike ----

AGENT_PROMPT, AGENT_REPLY = 1750, 384
QUICK_AGENT_PROMPT, QUICK_AGENT_REPLY = 600, 128
BURST_PREFIX = 1500
# decode at each concurrency, greedy (the figures' keys say `decode`) and sampled as chat UIs do
SAMPLING: dict[str, dict[str, float]] = {"decode": {}, "sampled": {"temperature": 0.7, "top_p": 0.95}}
CHAT = "What is the capital of France? One word."


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def light_rounds(urls: dict[str, str], quick: bool, rounds: int | None = None) -> dict[str, list[dict[str, float]]]:
    """Idle first token, decode at 1 and 8 streams, and a burst sharing a system prompt, on fresh
    prompts, for every system, by rounds. Within a round the systems take turns measure by
    measure (one request at a time for the idle first token, three turns each for one stream),
    so each ratio compares runs seconds apart: this machine's speed drifts by 10-20% over minutes.
    """
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in urls}
    for url in urls.values():
        load.send(url, load.Chat(_user("Hello."), 4))  # warm-up: first-request costs are not steady state
    for round_ in range(rounds or (2 if quick else 3)):
        seed = 1000 * round_ + 1
        order = list(urls) if round_ % 2 == 0 else list(reversed(urls))  # who goes first changes too
        idle: dict[str, list[float]] = {name: [] for name in urls}
        for i in range(5 if quick else 9):
            for name in order:
                idle[name].append(load.send(urls[name], load.Chat(_user(f"{CHAT} ({seed}-{i})"), 16)).ttft)
        measured = {name: {"idle": float(np.median(idle[name]))} for name in urls}
        for n, turns in ((1, 3), (2, 1), (4, 1), (8, 1)):
            for how, sampling in SAMPLING.items():
                rates: dict[str, list[float]] = {name: [] for name in urls}
                gaps: dict[str, list[float]] = {name: [] for name in urls}
                for turn in range(turns):
                    for name in order:
                        stories = [
                            load.Chat(
                                _user(f"Tell me a long story about lighthouse {seed}-{n}-{turn}-{i}."),
                                256,
                                extra={**sampling, "seed": seed + i} if sampling else {},
                            )
                            for i in range(n)
                        ]
                        replies = load.together(urls[name], stories)
                        rates[name].append(load.decode_rate(replies))
                        gaps[name].append(load.gap_p99(replies))
                for name in urls:
                    measured[name][f"{how}{n}"] = float(np.median(rates[name]))
                    measured[name][f"{how}_gap{n}"] = float(np.median(gaps[name]))
        system = load.document(seed + 1, BURST_PREFIX // 3 if quick else BURST_PREFIX)
        questions = 8 if quick else 16
        asked = [
            load.Chat([{"role": "system", "content": system}, *_user(f"Question {i}: what is word {i}?")], 8)
            for i in range(questions + 1)  # the last one asks after the burst
        ]
        for name in order:
            burst = asked[:questions]
            replies, measured[name]["burst_wall"] = load.timed(functools.partial(load.together, urls[name], burst))
            measured[name]["burst_prefilled"] = sum(r.prompt_tokens - r.cached_tokens for r in replies)
            if name == "superfluid":
                # the fewest a burst can prefill: one prompt whole, then each other's tokens past the part they all
                # share, which the cache gives a later question of the same shape
                shared = load.send(urls[name], asked[questions]).cached_tokens
                least = sum(r.prompt_tokens for r in replies) - (len(replies) - 1) * shared
                measured[name]["burst_least"] = least
        for name in urls:
            figures[name].append(measured[name])
            print(f"http round {round_ + 1}, {name}: {measured[name]}", flush=True)
    return figures


def agent_shape(quick: bool) -> tuple[int, int]:
    """An agent's prompt and reply, in tokens."""
    return (QUICK_AGENT_PROMPT, QUICK_AGENT_REPLY) if quick else (AGENT_PROMPT, AGENT_REPLY)


def agents_round(url: str, quick: bool, seed: int, agent_qos: str | None, chat_qos: str | None) -> dict[str, float]:
    """One agent alone on the idle server (a prompt of the same length, its own words), then eight agents with
    long prompts of their own and a short chat two seconds after they start."""
    prompt, reply = agent_shape(quick)

    def agent(i: int) -> load.Chat:
        return load.Chat(_user(load.document(i, prompt)), reply, agent_qos)

    alone = load.send(url, agent(seed + 8))
    agents = list(map(agent, range(seed, seed + 8)))
    replies = load.together(url, [*agents, load.Chat(_user(CHAT), 16, chat_qos)], [0.0] * 8 + [2.0])
    ttfts = [r.ttft for r in replies[:8]]
    figures = {
        "wall": max(r.done for r in replies[:8]) - min(r.sent for r in replies[:8]),
        "p50": float(np.median(ttfts)),
        "max": max(ttfts),
        "chat": replies[8].ttft,
        "stall": max(max(r.gaps, default=0.0) for r in replies[:8]),
        "completed": sum(
            r.error is None and r.completion_tokens == a.max_tokens for r, a in zip(replies[:8], agents, strict=True)
        ),
        "alone_first": alone.ttft,
    }
    print(
        f"  agents {agent_qos or 'no header'}, chat {chat_qos or 'no header'}: agents' wall {figures['wall']:.1f} s, "
        f"first token p50 {figures['p50']:.1f} s, max {figures['max']:.1f} s; chat first token {figures['chat']:.2f} s;"
        f" one agent alone: first token {alone.ttft:.1f} s",
        flush=True,
    )
    return figures


def agents_floor(mine: dict[str, float], peer: dict[str, float], together: float) -> dict[str, float]:
    """What no scheduler beats on this machine, from one agent alone on either server of a paired round (the
    quicker one's first token) and `together`, the seconds llama.cpp's own loop takes to decode the eight replies
    side by side: eight prompts prefilled back to back, then their replies decoded together (wall), and the
    median of the eight first tokens of that order (p50: 4.5 prompts' prefill). It leaves out the tokens a reply
    could take along with a later prompt's prefill, one in each of its micro-batches of 512: a few of hundreds."""
    first = min(mine["alone_first"], peer["alone_first"])
    return {"wall": 8 * first + together, "p50": 4.5 * first, "first": first, "decode": together}


def http_section(
    peers: Path | None,
    quick: bool,
    threads: int,
    root: Path,
    rounds: int | None = None,
    model: Path | None = None,
    gpu_layers: str | None = None,
) -> list[Result]:
    """The HTTP figures against llama-server, on `model` (the embedded one when None), with `gpu_layers` of it
    on the GPU in both systems where given (a GPU build runs fast kernels by default: the second setting is left
    out there)."""
    window, lanes = 4096, 8
    model = model or embedded_model().path
    served = (str(model), *(("--gpu-layers", gpu_layers) if gpu_layers else ()))
    systems: dict[str, Callable[..., Superfluid | LlamaServer]] = {
        "superfluid": lambda tag, *extra: Superfluid(
            root / f"superfluid-{tag}", window, lanes, *served, "--threads", str(threads), *extra
        )
    }
    fast = (*served, "--threads", str(threads), "--kernels", "fast")
    agent_systems = dict(systems)
    if not gpu_layers:
        agent_systems["superfluid fast"] = lambda tag: Superfluid(root / f"fast-{tag}", window, lanes, *fast)
    offload = ("-ngl", "999" if gpu_layers == "all" else gpu_layers) if gpu_layers else ()
    server_binary = peers / "fast" / "bin" / "llama-server" if peers else None
    together = 0.0  # the agents' replies decoded side by side by llama.cpp's loop, for their floor
    if server_binary is not None and server_binary.exists():
        systems["llama-server"] = agent_systems["llama-server"] = lambda tag, *_: LlamaServer(
            server_binary, model, root / f"llama-server-{tag}", lanes, window, threads, *offload
        )
        batched = server_binary.with_name("llama-batched-bench")
        together = fastest_loop(batched, model, *agent_shape(quick), 8, threads, phase="t_tg")["t_tg"]
        print(f"http agents: llama.cpp's loop decodes eight replies together in {together:.1f} s", flush=True)
    else:
        print("http: llama-server not built (make bench builds it); its column is left out", flush=True)
    # the light figures with every system up and one driven at a time; parking is off there,
    # since superfluid's idle parking would write while the other system is measured
    with contextlib.ExitStack() as up:
        urls = {}
        for name, make in systems.items():
            extra = ("--no-park",) if name == "superfluid" else ()
            server = up.enter_context(make("light", *extra))
            urls[name] = server.url
        light = light_rounds(urls, quick, rounds)
    # superfluid and llama-server take turns, round by round, as the light figures do; the fast kernels
    # and the chat without a header once
    agents: dict[tuple[str, str], list[dict[str, float]]] = {}
    header = ("with the QoS header", "background", "interactive")
    paired = [("superfluid", *header), ("llama-server", "plain", None, None)]
    plans = [
        *paired * (rounds or (2 if quick else 3)),
        ("superfluid fast", *header),
        ("superfluid", "plain", None, None),
    ]
    for index, (name, label, agent_qos, chat_qos) in enumerate(plans):
        if name in agent_systems:
            print(f"http agents: {name}, {label}", flush=True)
            with agent_systems[name](f"agents-{label}") as server:
                figures = agents_round(server.url, quick, 500 + index * 100, agent_qos, chat_qos)
            agents.setdefault((name, label), []).append(figures)
    return http_results(light, agents, quick, together)


def http_results(
    light: dict[str, list[dict[str, float]]],
    agents: dict[tuple[str, str], list[dict[str, float]]],
    quick: bool,
    together: float,
) -> list[Result]:
    ours = light["superfluid"]
    theirs = light.get("llama-server")
    results = []

    def compare(name: str, key: str, target: str, better: str, unit: str, headline: str = "") -> None:
        passed = _meets(target)
        mine = [r[key] for r in ours]
        if theirs is None:
            median = float(np.median(mine))
            detail = f"superfluid {median:.3f} {unit}; no llama-server figure"
            results.append(Result(name, median, target, False, detail, unit, rounds={f"superfluid {unit}": mine}))
            return
        ratios = [a[key] / b[key] for a, b in zip(ours, theirs, strict=True)]
        middle = median_round(ratios)
        ratio = ratios[middle]
        detail = (
            f"{ours[middle][key]:.3f} {unit} vs {theirs[middle][key]:.3f} {unit} in the median of {len(ours)} "
            f"paired rounds (ratios {', '.join(f'{r:.2f}' for r in ratios)})"
        )
        raw = {f"superfluid {unit}": mine, f"llama-server {unit}": [r[key] for r in theirs], "ratio": ratios}
        results.append(Result(name, ratio, target, passed(ratio), detail, "x", "llama-server", better, headline, raw))

    compare("idle first token over HTTP / llama-server", "idle", "<= 1.2", "lower", "s", "first token, idle server")
    for n in (1, 2, 4, 8):
        streams = "1 stream" if n == 1 else f"{n} streams"
        headline = f"decode, {streams}" if n in (1, 8) else ""
        compare(
            f"decode tok/s over HTTP, {streams} / llama-server", f"decode{n}", ">= 1.0", "higher", "tok/s", headline
        )
        compare(f"sampled decode tok/s over HTTP, {streams} / llama-server", f"sampled{n}", ">= 1.0", "higher", "tok/s")
        for how in ("decode", "sampled"):
            kind = "greedy" if how == "decode" else "sampled"
            compare(f"inter-chunk gap p99, {kind}, {streams} / llama-server", f"{how}_gap{n}", "<= 1.0", "lower", "s")
    prefix = BURST_PREFIX // 3 if quick else BURST_PREFIX
    prefilled = float(np.median([r["burst_prefilled"] for r in ours]))
    least = float(np.median([r["burst_least"] for r in ours]))
    peer_prefilled = f", llama-server {np.median([r['burst_prefilled'] for r in theirs]):.0f}" if theirs else ""
    raw = {"superfluid tokens prefilled": [r["burst_prefilled"] for r in ours]}
    raw["the fewest a burst prefills"] = [r["burst_least"] for r in ours]
    if theirs:
        raw["llama-server tokens prefilled"] = [r["burst_prefilled"] for r in theirs]
    results.append(
        Result(
            f"burst sharing a {prefix}-token system prompt: tokens prefilled / the fewest",
            prefilled / least,
            "<= 1.2",
            prefilled / least <= 1.2,
            f"superfluid {prefilled:.0f}{peer_prefilled} tokens prefilled; the fewest {least:.0f}: one prompt "
            "whole and the rest past the part they all share",
            "x",
            "the fewest tokens the burst can prefill",
            rounds=raw,
        )
    )
    compare("burst sharing a system prompt: wall / llama-server", "burst_wall", "<= 0.5", "lower", "s")
    rounds, (plain,) = agents[("superfluid", "with the QoS header")], agents[("superfluid", "plain")]
    fast = next(iter(agents.get(("superfluid fast", "with the QoS header"), [])), None)
    peers = agents.get(("llama-server", "plain"), [])

    def below_peer(name: str, ratio: float, target: str, detail: str, raw: dict[str, list[float]]) -> None:
        """A row of a ratio to llama-server's seconds, where lower is better."""
        passed = target.startswith("(") or _meets(target)(ratio)
        results.append(Result(name, ratio, target, passed, detail, "x", "llama-server", "lower", "", raw))

    mine, peer = rounds[0], peers[0] if peers else None
    for key, name, target in (
        ("wall", "eight agents' wall / llama-server", "<= 0.7"),
        ("p50", "agent first token p50 / llama-server", "<= 0.8"),
    ):
        if peer is None:
            results.append(Result(name, mine[key], target, False, "no llama-server figure", "s"))
            continue
        ratios = [a[key] / b[key] for a, b in zip(rounds, peers, strict=True)]
        middle = median_round(ratios)
        mine, peer = rounds[middle], peers[middle]
        raw = {"superfluid s": [r[key] for r in rounds], "llama-server s": [r[key] for r in peers], "ratio": ratios}
        detail = (
            f"{mine[key]:.1f} s vs {peer[key]:.1f} s in the median of {len(ratios)} paired rounds "
            f"(ratios {', '.join(f'{r:.2f}' for r in ratios)})"
        )
        below_peer(name, ratios[middle], target, detail, raw)
        floors = [agents_floor(a, b, together) for a, b in zip(rounds, peers, strict=True)]
        floor = floors[middle]
        detail = (
            f"{floor[key]:.1f} s vs {peer[key]:.1f} s: one agent alone took {floor['first']:.1f} s to its first token "
            "(the quicker server's, the median round)"
        )
        if key == "wall":
            detail += f", and llama.cpp's loop decoded eight replies together in {floor['decode']:.1f} s"
        raw = {"floor s": [f[key] for f in floors], "llama-server s": [r[key] for r in peers]}
        below_peer(f"{name}: the floor", floor[key] / peer[key], "(reported)", detail, raw)
        if fast is None:
            continue
        detail = f"{fast[key]:.1f} s vs {peer[key]:.1f} s (the median round's)"
        raw = {"superfluid --kernels fast s": [fast[key]], "llama-server s": [peer[key]]}
        below_peer(f"{name}, --kernels fast", fast[key] / peer[key], "(reported)", detail, raw)
    slowest = max(r["chat"] for r in rounds)
    results.append(
        Result(
            "chat first token behind 8 agents, QoS header (s)",
            slowest,
            "<= 0.5 s",
            slowest <= 0.5,
            f"the slowest of {len(rounds)} rounds",
            "s",
            rounds={"superfluid s": [r["chat"] for r in rounds]},
        )
    )
    results.append(
        Result(
            "chat first token behind 8 agents, no header (s)",
            plain["chat"],
            "<= 2.0 s",
            plain["chat"] <= 2.0,
            f"llama-server {peer['chat']:.2f} s" if peer else "",
            "s",
            rounds={"superfluid s": [plain["chat"]], **({"llama-server s": [peer["chat"]]} if peer else {})},
        )
    )
    stalls, peer_stall = [r["stall"] for r in rounds], max((r["stall"] for r in peers), default=None)
    results.append(
        Result(
            "longest wait between a started agent's tokens, QoS header (s)",
            max(stalls),
            "<= 5.0 s",
            max(stalls) <= 5.0,
            f"the longest of {len(rounds)} rounds" + (f"; llama-server {peer_stall:.2f} s" if peer else ""),
            "s",
            rounds={"superfluid s": stalls, **({"llama-server s": [r["stall"] for r in peers]} if peer else {})},
        )
    )
    completed = [r["completed"] for r in [*rounds, plain]]
    results.append(
        Result(
            "agents completed, every round",
            min(completed) / 8,
            ">= 1.0",
            min(completed) == 8,
            f"{sum(completed)} of {8 * len(completed)} agents ran to their max_tokens",
            "share",
            rounds={
                "superfluid agents": completed,
                **({"llama-server agents": [r["completed"] for r in peers]} if peer else {}),
            },
        )
    )
    return results


def _meets(target: str) -> Callable[[float], bool]:
    """A target such as "<= 1.2" or ">= 0.95" as a test of a value."""
    sign, bound = target.split()[:2]
    limit = float(bound)
    return (lambda v: v <= limit) if sign == "<=" else (lambda v: v >= limit)


def report(results: list[Result]) -> None:
    width = max((len(r.name) for r in results), default=0)
    for r in results:
        mark = "ok " if r.passed else "MISS"
        print(f"{mark} {r.name.ljust(width)}  {r.value:8.3f}  target {r.target:<26} {r.detail}", flush=True)


@dataclass
class Run:
    """The options every section runs with, and what one section hands the next."""

    quick: bool
    rounds: int | None
    threads: int
    root: Path
    peers: Path | None
    fastest: dict[int, float] = field(default_factory=dict)  # engine's fastest decode, for socket
    model: Path | None = None  # the http section's model; None: the embedded one
    gpu_layers: str | None = None  # the http section's layers on the GPU, in both systems


def run_engine(run: Run) -> list[Result]:
    if run.peers is None:
        print("engine: no --peers given (make bench builds them); section skipped", flush=True)
        return []
    results, run.fastest = engine_section(run.peers, run.quick, run.threads, rounds=run.rounds or 3)
    return results


def run_startup(run: Run) -> list[Result]:
    print("startup: a daemon served again after a SIGKILL", flush=True)
    return startup_figures(run.root, run.threads, run.rounds)


def run_spec(run: Run) -> list[Result]:
    print("spec: speculative decoding against none", flush=True)
    return spec_figures(run.root, run.quick, run.threads, run.rounds)


def run_ui(run: Run) -> list[Result]:
    print("ui: the browser UI in headless Chromium", flush=True)
    return ui_figures(run.root, run.quick, run.rounds)


def run_cluster(run: Run) -> list[Result]:
    print("cluster: the PostgreSQL store against SQLite, failover, forwarding and warm takeover", flush=True)
    return cluster_figures(run.root, run.threads, run.quick, run.rounds)


def run_agents(run: Run) -> list[Result]:
    print("agents: a Claude Code turn's first token, cold and warm", flush=True)
    return agent_figures(run.root, run.peers, run.quick, run.threads, run.rounds)


def large_model(run: Run, section: str, weights: str = "q4_1") -> tuple[Path, str] | None:
    """The random-weight model the `-large` sections run on (`weights` of that type), and its size in words
    (with the type, where it is not Q4_1); None without the peers."""
    if run.peers is None:
        print(f"{section}: needs --peers (llama.cpp's gguf-py writes the model; llama.cpp is compared)", flush=True)
        return None
    shape = Shape()
    model = random_model(run.peers, shape, weights=weights)
    size = f"{shape.parameters(LlamaModel(model, vocab_only=True).n_vocab) / 1e9:.1f}B"
    print(f"{section}: on {model.name}, {size} parameters of random weights", flush=True)
    return model, size if weights == "q4_1" else f"{size} {weights.upper()}"


def named_for(rows: list[Result], size: str) -> list[Result]:
    """A section's rows, each named for the model they were measured on."""
    for row in rows:
        row.name = f"{row.name}, {size} model"
        row.headline = f"{row.headline}, {size} model" if row.headline else ""
    return rows


def run_engine_large(run: Run, section: str = "engine-large", weights: str = "q4_1") -> list[Result]:
    """The engine section on a model of the size people run: prefill and decode of each configuration."""
    found = large_model(run, section, weights)
    if found is None or run.peers is None:
        return []
    model, size = found
    return named_for(engine_section(run.peers, run.quick, run.threads, model, run.rounds or 3)[0], size)


def run_http_large(run: Run) -> list[Result]:
    """The HTTP section again on a model of the size people run (`random_model.py`), every figure named for it."""
    found = large_model(run, "http-large")
    if found is None:
        return []
    model, size = found
    return named_for(http_section(run.peers, run.quick, run.threads, run.root / "large", run.rounds, model), size)


def run_sustained_large(run: Run) -> list[Result]:
    """The soak and the oversubscribed burst on the random-weight model."""
    found = large_model(run, "sustained-large")
    if found is None:
        return []
    model, size = found
    return named_for(sustained_section(run.peers, run.quick, run.threads, run.root / "large", model), size)


RUNNERS: dict[str, Callable[[Run], list[Result]]] = {
    "engine": run_engine,
    "http": lambda run: http_section(
        run.peers, run.quick, run.threads, run.root, run.rounds, run.model, run.gpu_layers
    ),
    "socket": lambda run: socket_section(run.quick, run.root, run.fastest, run.threads, run.rounds),
    "park": lambda run: park_section(run.root, run.threads, run.quick),
    "startup": run_startup,
    "spec": run_spec,
    "ui": run_ui,
    "cluster": run_cluster,
    "agents": run_agents,
    "engine-large": run_engine_large,
    "engine-q4km": lambda run: run_engine_large(run, "engine-q4km", "q4_k_m"),
    "engine-q5k": lambda run: run_engine_large(run, "engine-q5k", "q5_k"),
    "http-large": run_http_large,
    "sustained": lambda run: sustained_section(run.peers, run.quick, run.threads, run.root, embedded_model().path),
    "sustained-large": run_sustained_large,
}
assert tuple(RUNNERS) == SECTIONS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--peers", type=Path, help="where `make peers` built llama-server and llama-batched-bench")
    parser.add_argument("--only", choices=SECTIONS, help="run one section")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="threads for every system")
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of each measure, in every section that repeats its measures (default: each section's own; "
        "engine and park measure once)",
    )
    parser.add_argument("--model", type=Path, help="the http section's GGUF (default: the embedded model)")
    parser.add_argument("--gpu-layers", metavar="N|all", help="the http section's layers on the GPU, in both systems")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the figures go (default: %(default)s)")
    parser.add_argument(
        "--keep-state",
        action="store_true",
        help="keep the daemons' sessions, parks and logs after the run (several GB a section; removed by default)",
    )
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    run = Run(args.quick, args.rounds, args.threads, Path(tempfile.mkdtemp(prefix="superfluid-bench-")), args.peers)
    run.model, run.gpu_layers = args.model, args.gpu_layers
    settings = {"quick": args.quick, "rounds": args.rounds, "threads": args.threads}
    if args.model is not None or args.gpu_layers:
        settings.update(model=args.model.name if args.model else None, gpu_layers=args.gpu_layers)
    results: list[Result] = []
    try:
        for section in [args.only] if args.only else SECTIONS:
            began = time.monotonic()
            rows = RUNNERS[section](run)
            if rows:  # a section that measured nothing (a peer or a tool missing) keeps its last file
                save(section, rows, settings, args.results)
            print(f"{section}: {time.monotonic() - began:.0f} s", flush=True)
            results += rows
    finally:
        if args.keep_state:
            print(f"the daemons' state is kept in {run.root}", flush=True)
        else:
            shutil.rmtree(run.root, ignore_errors=True)
    print()
    report(results)
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
