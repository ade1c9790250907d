"""Shared fixtures: a real `superfluid serve` on the embedded model, in temporary dirs.

The model's greedy text differs from CPU to CPU (llama.cpp picks SIMD kernels for the
machine it is built on), so tests rely only on what holds on every machine, through the
helpers below that say which property they need:
- `forced`: with end-of-generation banned (`ignore_eos`), a generation yields exactly the
  tokens asked for;
- `reference` comparisons: the same request twice gives the same tokens, and a cut,
  resumed or forked run gives the tokens of the uncut one;
- `ENDS_TURN`: a grammar whose only sentence is fixed, so a turn ends (finish 3) at a known point.
Run the suite with `SUPERFLUID_TEST_LOGIT_SKEW=<n>` to see it hold when the model's words change.

The `reference` comparisons are promises of the exact kernels, so every daemon a test starts
asks for them (`SUPERFLUID_KERNELS=exact`: refused, not fallen back from, where they cannot run)
unless the test says otherwise; test_kernels.py starts daemons on the default and on fast kernels.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from pgcluster import PostgresCluster

from superfluid.client import SocketClient
from superfluid.metrics import read_metric
from superfluid.protocol.schema import FINISH_LENGTH, GenParams, Request, Response

os.environ.setdefault("SUPERFLUID_KERNELS", "exact")


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark e2e the tests that start PostgreSQL or Chromium, whatever their module says: `make unit`
    installs neither, and test_store.py runs its plain tests on SQLite and on PostgreSQL (a
    parameter "postgresql", whose fixture asks for `postgres` only as it runs)."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_postgres = callspec is not None and "postgresql" in map(str, callspec.params.values())
        if on_postgres or {"postgres", "browser"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
# The chat templates of real model families, from the llama.cpp source `make` builds (Makefile)
TEMPLATES = Path(__file__).resolve().parent.parent / ".venv" / "llama-templates"
# one family's template per tool-call dialect
FAMILY_TEMPLATES = {
    "hermes": "Qwen-Qwen3-0.6B.jinja",
    "qwen3-coder": "Qwen3-Coder.jinja",
    "harmony": "openai-gpt-oss-120b.jinja",
    "llama3": "meta-llama-Llama-3.1-8B-Instruct.jinja",
    "mistral": "unsloth-mistral-Devstral-Small-2507.jinja",
    "mistral-json": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "deepseek": "deepseek-ai-DeepSeek-V3.1.jinja",
    "kimi": "moonshotai-Kimi-K2.jinja",
    "glm": "GLM-4.6.jinja",
    "glm-4.7": "GLM-4.7-Flash.jinja",
    "granite": "ibm-granite-granite-3.3-2B-Instruct.jinja",
    "gemma": "google-gemma-4-31B-it.jinja",
}
# A grammar with one sentence: the turn ends after it on any machine (finish 3).
ENDS_TURN = 'root ::= "Hello there."'
# A reply constrained to one of two words, as a Responses text format: the turn ends normally on any machine
CITY = {
    "type": "json_schema",
    "name": "city",
    "schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def openai_at(url: str, api_key: str = "unused", **options: Any) -> Any:
    """The official OpenAI client of the API at `url` (a daemon with no key takes any)."""
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, **options)


class DaemonProcess:
    """A `superfluid serve` subprocess on a sessions dir and socket of its own."""

    def __init__(self, root: Path, *extra: str, max_context: int = 2048, max_batch: int = 4) -> None:
        self.root = root
        self.sessions = root / "sessions"
        self.socket = root / "sf.sock"
        self.log = root / "serve.log"
        self.args = [
            sys.executable,
            "-m",
            "superfluid",
            "serve",
            "--sessions",
            str(self.sessions),
            "--socket",
            str(self.socket),
            "--max-context",
            str(max_context),
            "--max-batch",
            str(max_batch),
            "--no-http",
            "--no-tui",
            "--log-filter",
            os.environ.get("SF_TEST_LOG", "info"),
            *extra,
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> DaemonProcess:
        """Start the daemon and return once it serves: when it sends READY=1 to $NOTIFY_SOCKET (systemd's
        protocol, on an abstract socket of this start's own), which it does once every listener is up."""
        self.root.mkdir(parents=True, exist_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as ready:
            name = f"superfluid-test-{os.getpid()}-{secrets.token_hex(8)}"
            ready.bind("\0" + name)
            ready.settimeout(0.05)
            env = {**os.environ, "NOTIFY_SOCKET": "@" + name}
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    if b"READY=1" in ready.recv(4096).split(b"\n"):
                        return self
                except TimeoutError:
                    pass
                if self.proc.poll() is not None:
                    raise RuntimeError(f"superfluid exited with {self.proc.returncode}:\n{self.log.read_text()}")
        raise RuntimeError(f"superfluid did not start:\n{self.log.read_text()}")

    def client(self) -> SocketClient:
        return SocketClient(self.socket)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebDaemon]:
    proc = WebDaemon(tmp_path_factory.mktemp("daemon")).start()
    yield proc
    proc.stop()


@pytest.fixture
def sf(daemon: DaemonProcess) -> Iterator[SocketClient]:
    with daemon.client() as client:
        yield client


def new_session(client: SocketClient, params: GenParams = GREEDY) -> int:
    reply = client.call(Request.Create(None, params))
    assert isinstance(reply, Response.Created), reply
    return reply.session


def say(client: SocketClient, session: int, text: str, role: int = 1) -> Response.Committed:
    reply = client.call(Request.AppendMessage(session, role, text))
    assert isinstance(reply, Response.Committed), reply
    return reply


def generate(
    client: SocketClient, session: int, max_tokens: int, *, ignore_eos: bool = False
) -> tuple[list, Response.Generated]:
    """The Deltas and the summary of one Generate; fails on an Err."""
    replies = list(client.generate(session, max_tokens, ignore_eos=ignore_eos))
    *deltas, summary = replies
    assert isinstance(summary, Response.Generated), summary
    assert all(isinstance(d, Response.Delta) for d in deltas)
    return [d.event for d in deltas], summary


def forced(client: SocketClient, session: int, tokens: int) -> tuple[list, Response.Generated]:
    """A generation with end-of-generation banned: exactly `tokens` tokens, on every machine."""
    deltas, summary = generate(client, session, tokens, ignore_eos=True)
    assert summary.tokens_generated == tokens and summary.finish == FINISH_LENGTH, summary
    assert len(generated_tokens(deltas)) == tokens
    return deltas, summary


def generated_tokens(events: list) -> list[int]:
    return [t for e in events if type(e.body).__name__ == "Generated" for t in e.body.span]


def text_of(events: list) -> str:
    return "".join(e.body.text for e in events if type(e.body).__name__ == "Generated")


# a tool whose argument is one of a few words, so a forced call completes on any machine
CITY_FUNCTION = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
        "required": ["city"],
    },
}


def chat_body(content: str, max_tokens: int, stream: bool) -> dict:
    """An OpenAI chat request of exactly `max_tokens` greedy tokens, on any machine."""
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
    }


# the kernel hands out ports of its ephemeral range on its own (a client's source port, a bind to port 0): a
# port taken from it and released could be handed out again before the server it was picked for binds it
# (CI once saw a cluster daemon fail so, "Address already in use"); ports below the range are only ever taken
# by a bind that names them
EPHEMERAL_PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PICKED_PORT = 10000


def children(pid: int) -> list[int]:
    """Pids of a process's children (alive, or dead and not yet reaped), whichever of its threads started them."""
    tasks = Path(f"/proc/{pid}/task")
    return [int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()]


def free_port() -> int:
    """A loopback port nothing is bound to, from below the kernel's ephemeral range."""
    ephemeral = int(EPHEMERAL_PORT_RANGE.read_text().split()[0]) if EPHEMERAL_PORT_RANGE.exists() else 32768
    while True:
        port = secrets.choice(range(LOWEST_PICKED_PORT, ephemeral))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


class HttpDaemon(DaemonProcess):
    """A daemon with its HTTP API on a free loopback port."""

    def __init__(self, root: Path, *extra: str, **sizes: int) -> None:
        self.port = free_port()
        super().__init__(root, *extra, **sizes)
        self.args = [a for a in self.args if a != "--no-http"] + ["--http", f"127.0.0.1:{self.port}"]
        self.url = f"http://127.0.0.1:{self.port}"

    def metric(self, name: str) -> float:
        """A figure of /metrics, summed over its labels."""
        import httpx

        return present_metric(httpx.get(f"{self.url}/metrics").text, name)


class WebDaemon(DaemonProcess):
    """A daemon with the browser transport on a free loopback port."""

    def __init__(self, root: Path, *extra: str, origins: tuple[str, ...] = (), **sizes: int) -> None:
        self.port = free_port()
        flags = ["--web", f"127.0.0.1:{self.port}"]
        for origin in origins:
            flags += ["--web-origin", origin]
        super().__init__(root, *flags, *extra, **sizes)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.sessions / "web-token").read_text()

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}", "x-superfluid-csrf": self.token}


def web_stream(daemon: WebDaemon, body: dict) -> list[dict]:
    """The frames of one POST /web/stream, up to its summary."""
    import json

    import httpx

    frames = []
    with httpx.stream("POST", f"{daemon.url}/web/stream", json=body, headers=daemon.headers(), timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line[len("data: ") :]))
    return frames


def end_turn(daemon: WebDaemon, session: int) -> list[dict]:
    """Generate a turn that ends on every machine at the same point: the `ENDS_TURN` sentence."""
    frames = web_stream(daemon, {"session": session, "max_tokens": 64, "grammar": ENDS_TURN})
    assert frames[-1]["done"]["finish"] == 3, frames[-1]
    return frames


def metric(client: SocketClient, name: str) -> float:
    """A figure of the daemon's `Metrics`, summed over its labels."""
    return present_metric(client.call(Request.Metrics()).text, name)


def present_metric(exposition: str, name: str) -> float:
    """`read_metric`, which says 0 for a name it does not find: here a missing name fails instead."""
    family = name.split("{", 1)[0]
    assert re.search(rf"^{re.escape(family)}[{{ ]", exposition, re.MULTILINE), f"{family} is not in the metrics"
    return read_metric(exposition, name)


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's headless Chromium, driven by Playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Debian's chromium is needed: apt-get install chromium (make test does it)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        yield browser
        browser.close()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresCluster]:
    """A PostgreSQL cluster the tests share (`.database()` gives each its own database)."""
    cluster = PostgresCluster()
    try:
        yield cluster
    finally:
        cluster.remove()
