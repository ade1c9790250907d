"""The unix-socket transport: u32 little-endian length + postcard frames.

A frame longer than 64 MiB, a short read inside a frame, or bytes that do not decode
as a `Request` end that connection (no `Err` is sent, as the protocol says); every
other connection goes on. The socket file is created with mode 0600, and a stale file
left by a killed daemon is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import MAX_FRAME
from ..core.daemon import Daemon
from ..protocol import postcard
from ..protocol.schema import Request, Response
from .connection import Connection

if TYPE_CHECKING:  # httpx and starlette load with the HTTP listeners, off the start's path, the SDK with tracing
    from ..telemetry.tracing import Tracing
    from .forward import Forwarder

log = logging.getLogger("superfluid.socket")
UNIX_PATH_MAX = 108  # sun_path on Linux, terminator included


class SocketServer:
    """Serves the session API on a unix socket."""

    def __init__(
        self, daemon: Daemon, path: Path, forwarder: Forwarder | None = None, tracing: Tracing | None = None
    ) -> None:
        self.daemon = daemon
        self.path = path
        self.forwarder = forwarder
        self.tracing = tracing
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if len(os.fsencode(self.path)) >= UNIX_PATH_MAX:
            raise RuntimeError(
                f"the socket path {self.path} is {len(os.fsencode(self.path))} bytes, over the "
                f"{UNIX_PATH_MAX - 1} a unix socket allows; pass a shorter --socket"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists() or self.path.is_symlink():
            if not stat.S_ISSOCK(self.path.lstat().st_mode):
                raise RuntimeError(f"{self.path} exists and is not a socket; remove it or pass another --socket")
            self.path.unlink()  # left by a daemon that did not shut down
        previous = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(self._accept, path=str(self.path), limit=1 << 16)
        finally:
            os.umask(previous)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        write_lock = asyncio.Lock()

        async def send(response: Response) -> None:
            payload = postcard.encode(response, Response)
            async with write_lock:
                writer.write(len(payload).to_bytes(4, "little") + payload)
                await writer.drain()

        connection = Connection(self.daemon, send, self.forwarder, "socket", self.tracing)
        try:
            while True:
                request = await _read_frame(reader)
                if request is None:
                    break
                await connection.handle(request)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("socket connection failed")
        finally:
            await connection.close()
            self._connections.discard(task)
            writer.close()


async def _read_frame(reader: asyncio.StreamReader) -> object | None:
    """The next request, or None when the connection should end."""
    header = await reader.read(4)
    if not header:
        return None  # a clean close at a frame boundary
    if len(header) < 4:
        header += await reader.readexactly(4 - len(header))
    length = int.from_bytes(header, "little")
    if length > MAX_FRAME:
        log.warning("closing a connection that sent a %d-byte frame (limit %d)", length, MAX_FRAME)
        return None
    payload = await reader.readexactly(length)
    try:
        return postcard.decode(payload, Request)
    except postcard.DecodeError as e:
        log.warning("closing a connection that sent an undecodable frame: %s", e)
        return None
