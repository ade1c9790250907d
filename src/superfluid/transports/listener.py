"""An ASGI app served by uvicorn inside the daemon's own event loop.

The daemon binds the socket itself, so a port in use is a clear start-up error rather
than uvicorn exiting the process, and it keeps its own signal handling.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

WS_MESSAGE_LIMIT = 64 << 20


class _EmbeddedServer(uvicorn.Server):
    """uvicorn inside the daemon's loop: the daemon handles the signals itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpListener:
    """Serves `app` on one address."""

    def __init__(self, app: Any, host: str, port: int, what: str) -> None:
        self.host, self.port, self.what = host, port, what
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            ws="websockets-sansio",
            ws_max_size=WS_MESSAGE_LIMIT,
            lifespan="off",
            log_level="warning",
            access_log=False,
        )
        self._server = _EmbeddedServer(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> str:
        """Listen; returns the URL it listens on."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY on the connections of a
        # socket that names it, and without it a stream's small chunks wait for the client's
        # delayed ACK (40 ms per chunk on Linux, when the one before has not been acknowledged)
        listener = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(("127.0.0.1" if self.host == "localhost" else self.host, self.port))
        except OSError as e:
            listener.close()
            raise RuntimeError(f"{self.what} cannot listen on {self.host}:{self.port}: {e.strerror or e}") from None
        listener.setblocking(False)
        self._task = asyncio.create_task(self._server.serve(sockets=[listener]))
        while not self._server.started:
            await asyncio.sleep(0.01)
        bound = listener.getsockname()
        host = f"[{bound[0]}]" if family == socket.AF_INET6 else bound[0]
        return f"http://{host}:{bound[1]}"

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self._task, timeout=5)
