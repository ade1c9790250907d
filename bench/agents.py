"""Coding agents: a Claude Code turn's first token, cold and warm, on superfluid and on llama-server.

Claude Code (the version `make test` installs into .venv/agents) is run twice, headless
(`claude -p`), against a recorder that keeps its requests and answers each with an error: a
first question and a second one, with its default system prompt and two tools
(`--tools Read,Bash`: about 2,800 tokens on SmolLM2's tokenizer; its 25 tools are 23,000, past
the embedded model's window). Its main request of each run (the one with the tools; Claude Code
also sends a short one to title the session) is then sent to each server as Claude Code sent
it, streamed, with `max_tokens` cut to 16: the first turn on a fresh server (cold), then the
second (warm: the same system prompt and tools, another question). The time to first token is
until the first `content_block_delta`. Replaying the recorded bytes keeps the model's sampled
replies out of it: a 135M model's reply may run to Claude Code's cap, which Claude Code calls
an error and continues in further requests. Both servers run the same llama.cpp at 8 lanes of
8,192 tokens; llama-server serves the Anthropic API itself (`/v1/messages`, with `--jinja`).
llama-server leaves out tools a chat template has no place for (SmolLM2's has none), which
would spare it more than a third of the prompt: it is sent each request with the tools
written into the system prompt as superfluid writes them for such a template, so both
prefill the same conversation. Each line says how many prompt tokens each counted.
The systems take turns, three rounds each; each figure is the median of its rounds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
from peer import LlamaServer, Server, Superfluid
from record import Result

from superfluid.api.anthropic import client_tools, conversation
from superfluid.core.runtime import chat_template
from superfluid.engine.llama import LlamaModel
from superfluid.model.dialects import Dialect
from superfluid.model.resolve import embedded_model
from superfluid.model.tools import fallback_system_text

# where `make` links the agents it installs (Makefile: agents); the Claude Code there, else one on PATH
AGENT_BIN = Path(__file__).resolve().parents[1] / ".venv" / "agents" / "bin"
CLAUDE = shutil.which("claude", path=os.pathsep.join([str(AGENT_BIN), os.environ.get("PATH", "")]))
LEAN = ["--tools", "Read,Bash", "--output-format", "json", "-p"]
QUESTIONS = ("What does a harbour master do?", "Name three rivers in Peru.")
ROUNDS = 3
WINDOW, LANES = 8192, 8


class Recorder(BaseHTTPRequestHandler):
    """Keeps each POST body Claude Code sends, and answers it with an error so the run ends at once."""

    bodies: list[dict] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        Recorder.bodies.append(body)
        reply = b'{"type":"error","error":{"type":"invalid_request_error","message":"recorded"}}'
        self.send_response(400)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def claude_requests() -> list[dict]:
    """Claude Code's main request of a first and a second run, as it sends them."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    turns = []
    with tempfile.TemporaryDirectory() as home:
        env = {
            **os.environ,
            "HOME": home,
            "ANTHROPIC_BASE_URL": f"http://127.0.0.1:{server.server_port}",
            "ANTHROPIC_AUTH_TOKEN": "bench",
            "ANTHROPIC_MODEL": "SmolLM2-135M-Instruct",
            "ANTHROPIC_SMALL_FAST_MODEL": "SmolLM2-135M-Instruct",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "CLAUDE_CODE_MAX_RETRIES": "0",
        }
        for question in QUESTIONS:
            Recorder.bodies = []
            subprocess.run([CLAUDE, *LEAN, question], env=env, cwd=home, capture_output=True, timeout=300)
            turns.append(next(body for body in Recorder.bodies if body.get("tools")))
    server.shutdown()
    return turns


def embedded_dialect() -> Dialect:
    """The tool-call dialect superfluid gives the embedded model's template."""
    return chat_template(LlamaModel(embedded_model().path, vocab_only=True)).dialect


def with_tools_in_the_system_prompt(body: dict, dialect: Dialect) -> dict:
    """A Messages request whose tools are written into its system prompt, in the words and the
    call markup (`dialect`, the model's) superfluid gives a template with no place for tools:
    the request superfluid prefills, in a shape llama-server keeps whole."""
    chat = conversation(body.get("system"), body["messages"], body.get("tools") or [])
    system, *turns = chat.messages
    if system["role"] != "system" or any(
        turn["role"] not in ("user", "assistant") or "tool_calls" in turn for turn in turns
    ):
        raise ValueError("the recorded request has no system prompt, or turns other than text")
    folded = fallback_system_text(system["content"], client_tools(body.get("tools")), dialect)
    kept = {key: value for key, value in body.items() if key not in ("tools", "tool_choice", "system", "messages")}
    return kept | {"system": folded, "messages": turns}


def first_token(url: str, body: dict) -> tuple[float, dict]:
    """Seconds to the first streamed text of `body` (at most 16 tokens), and the usage it reported."""
    started = time.monotonic()
    first, usage = 0.0, {}
    request = {**body, "max_tokens": 16, "stream": True}
    with httpx.stream("POST", f"{url}/v1/messages", json=request, timeout=900) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url} answered {reply.status_code}: {reply.read()[:500]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "content_block_delta" and not first:
                first = time.monotonic() - started
            elif event["type"] in ("message_start", "message_delta"):
                usage |= event.get("message", event).get("usage") or {}
    return first, usage


def agent_figures(root: Path, peers: Path | None, quick: bool, threads: int, rounds: int | None = None) -> list[Result]:
    """Warm over cold on superfluid, and each over llama-server's; `rounds` turns (1 when quick, else ROUNDS)."""
    if CLAUDE is None:
        print("agents: Claude Code is not installed (make test installs it into .venv/agents); skipped", flush=True)
        return []
    systems: dict[str, Callable[[str], Server]] = {
        "superfluid": lambda tag: Superfluid(root / f"agents-sf-{tag}", WINDOW, LANES, "--threads", str(threads))
    }
    binary = peers / "fast" / "bin" / "llama-server" if peers else None
    if binary is not None and binary.exists():
        model = embedded_model().path
        systems["llama-server"] = lambda tag: LlamaServer(
            binary, model, root / f"agents-ls-{tag}", LANES, WINDOW, threads, "--jinja"
        )
    else:
        print("agents: llama-server not built (make bench builds it); its column is left out", flush=True)
    turns = claude_requests()
    dialect = embedded_dialect()
    sent = {"superfluid": turns, "llama-server": [with_tools_in_the_system_prompt(t, dialect) for t in turns]}
    first: dict[tuple[str, str], list[float]] = {}
    prompts: dict[tuple[str, str], tuple[int, int]] = {}  # (prompt tokens, of them read from the cache)
    for turn in range(rounds or (1 if quick else ROUNDS)):
        order = list(systems)[turn % len(systems) :] + list(systems)[: turn % len(systems)]
        for name in order:
            with systems[name](f"{turn}") as server:
                for kind, body in zip(("cold", "warm"), sent[name], strict=True):
                    seconds, usage = first_token(server.url, body)
                    first.setdefault((name, kind), []).append(seconds)
                    prompts[(name, kind)] = _prompt(usage)
                    print(f"agents: {name} {kind}: first token {seconds:.2f} s, {_said(usage)}", flush=True)
    median = {key: float(np.median(values)) for key, values in first.items()}

    def said(name: str, kind: str) -> str:
        tokens, read = prompts[(name, kind)]
        cold = f", {tokens / median[(name, kind)]:.0f} prompt tokens/s" if kind == "cold" else ""
        return f"{name} {median[(name, kind)]:.2f} s ({read} of {tokens} prompt tokens cached{cold})"

    sf_cold, sf_warm = median[("superfluid", "cold")], median[("superfluid", "warm")]
    share = sf_warm / sf_cold
    rows = [
        Result(
            "agents: Claude Code warm/cold first token",
            share,
            "<= 0.2",
            share <= 0.2,
            f"{said('superfluid', 'cold')}; {said('superfluid', 'warm')}",
            "x",
            "the cold turn on superfluid",
            "lower",
            rounds={"warm s": first[("superfluid", "warm")], "cold s": first[("superfluid", "cold")]},
        )
    ]
    if "llama-server" in systems:
        for kind in ("cold", "warm"):
            ours, theirs = median[("superfluid", kind)], median[("llama-server", kind)]
            detail = f"{said('superfluid', kind)}; {said('llama-server', kind)}"
            raw = {"superfluid s": first[("superfluid", kind)], "llama-server s": first[("llama-server", kind)]}
            rows.append(
                Result(
                    f"agents: Claude Code {kind} first token sf/llama-server",
                    ours / theirs,
                    "<= 1.0",
                    ours <= theirs,
                    detail,
                    "x",
                    "llama-server",
                    "lower",
                    f"first token of a Claude Code turn, {kind}",
                    raw,
                )
            )
    return rows


def _prompt(usage: dict) -> tuple[int, int]:
    """A prompt's tokens, and how many of them came from the cache, as the server reported them."""
    read = usage.get("cache_read_input_tokens") or 0
    return (usage.get("input_tokens") or 0) + read + (usage.get("cache_creation_input_tokens") or 0), read


def _said(usage: dict) -> str:
    tokens, read = _prompt(usage)
    return f"{read} of {tokens} prompt tokens read from the cache"
