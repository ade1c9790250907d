"""Shared fixtures: a real `superfluid serve` on the embedded model, in temporary dirs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from superfluid.client import SocketClient
from superfluid.protocol.schema import GenParams, Request, Response

GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)


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
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"superfluid exited with {self.proc.returncode}:\n{self.log.read_text()}")
            if b"superfluid 0.1.0: serving" in self.log.read_bytes()[offset:]:
                return self
            time.sleep(0.05)
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
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    proc = DaemonProcess(tmp_path_factory.mktemp("daemon")).start()
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


def generate(client: SocketClient, session: int, max_tokens: int) -> tuple[list, Response.Generated]:
    """The Deltas and the summary of one Generate; fails on an Err."""
    replies = list(client.generate(session, max_tokens))
    *deltas, summary = replies
    assert isinstance(summary, Response.Generated), summary
    assert all(isinstance(d, Response.Delta) for d in deltas)
    return [d.event for d in deltas], summary


def generated_tokens(events: list) -> list[int]:
    return [t for e in events if type(e.body).__name__ == "Generated" for t in e.body.span]


def text_of(events: list) -> str:
    return "".join(e.body.text for e in events if type(e.body).__name__ == "Generated")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
