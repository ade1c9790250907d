"""A blocking client of the unix socket, for scripts, tests and the `superfluid session` commands.

from superfluid.client import SocketClient
from superfluid.protocol.schema import GenParams, Request

with SocketClient() as sf:
    session = sf.call(Request.Create(None, GenParams(0.0, 1.0, 0.0, 0, 0))).session
    sf.call(Request.AppendMessage(session, 1, "Name three rivers."))
    for reply in sf.generate(session, 64):
        print(reply)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from .config import default_socket
from .protocol import postcard
from .protocol.schema import Request, Response


class SocketClient:
    """One connection to the daemon's socket; requests run one at a time."""

    def __init__(self, path: Path | str | None = None, timeout: float | None = 600.0) -> None:
        self.path = Path(path) if path is not None else default_socket()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(self.path))
        except OSError as e:
            self._sock.close()
            raise ConnectionError(
                f"cannot connect to the superfluid socket at {self.path} ({e.strerror or e}); "
                "is `superfluid serve` running with this --socket?"
            ) from None

    def send(self, request: Any) -> None:
        payload = postcard.encode(request, Request)
        self._sock.sendall(len(payload).to_bytes(4, "little") + payload)

    def receive(self) -> Any:
        length = int.from_bytes(self._read(4), "little")
        return postcard.decode(self._read(length), Response)

    def _read(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = self._sock.recv(min(n, 1 << 20))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def call(self, request: Any) -> Any:
        """Send one request and return its reply (an `Err` reply is returned, not raised)."""
        self.send(request)
        return self.receive()

    def generate(self, session: int, max_tokens: int, *, ignore_eos: bool = False) -> Iterator[Any]:
        """Every reply of a Generate: `Delta`s, then `Generated` (or `Err`); `ignore_eos` runs to `max_tokens`."""
        self.send(Request.Generate(session, max_tokens, ignore_eos or None))
        while True:
            reply = self.receive()
            yield reply
            if not isinstance(reply, Response.Delta):
                return

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> SocketClient:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()
