"""One client connection's request loop, shared by the socket and the WebSocket.

Requests run strictly one at a time, in order: a Generate streams its `Delta` frames
and its `Generated` summary before the next request starts. Subscriptions deliver on
their own tasks, so their frames interleave with other replies; the transport's `send`
writes each frame whole. Each Generate has an access line (and a trace, with `tracing`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..core.bus import END_UNSUBSCRIBED, SubEnded, Subscription
from ..core.daemon import Daemon
from ..core.errors import REFUSED, refusal
from ..core.generation import Committed, Done
from ..core.verbs.generate import Generation
from ..protocol.schema import Request, Response
from ..telemetry.access_log import AccessRecord, following
from .ratelimit import TokenBucket, retry_after_ms

if TYPE_CHECKING:  # httpx and starlette load with the HTTP listeners, off the start's path, the SDK with tracing
    from ..telemetry.tracing import Tracing
    from .forward import Forwarder

log = logging.getLogger("superfluid.transport")

Send = Callable[[Response], Awaitable[None]]


class Connection:
    """Runs one connection's requests against the daemon."""

    def __init__(
        self,
        daemon: Daemon,
        send: Send,
        forwarder: Forwarder | None = None,
        transport: str = "socket",
        tracing: Tracing | None = None,
    ) -> None:
        self.daemon = daemon
        self.send = send
        self.forwarder = forwarder  # a session another daemon of the store serves is asked of it
        self.transport = transport  # socket or ws, in access lines
        self.tracing = tracing
        self.completions = TokenBucket()
        self._subs: dict[int, tuple[Subscription, asyncio.Task[None]]] = {}
        self._generation: Generation | None = None

    async def handle(self, request: object) -> None:
        if isinstance(request, Request.Generate):
            await self._generate(request)
        elif isinstance(request, Request.Subscribe):
            await self._subscribe(request)
        elif isinstance(request, Request.Unsubscribe):
            await self._unsubscribe(request)
        elif isinstance(request, Request.Complete) and (wait := self.completions.take()):
            await self.send(Response.Throttled(retry_after_ms(wait)))
        else:
            reply = await self.daemon.request(request)
            if self.forwarder is not None and self._forwardable(reply):
                reply = await self.forwarder.call(request, reply)
            await self.send(reply)

    def _forwardable(self, reply: object) -> bool:
        """A refusal naming a daemon that serves the session, whose session API can be asked."""
        return (
            self.forwarder is not None
            and isinstance(reply, Response.Elsewhere)
            and self.forwarder.reaches(reply.address)
        )

    async def _generate(self, request: Request.Generate) -> None:
        record = AccessRecord(self.transport, "Generate")
        record.session = request.session
        if self.tracing is not None:
            attributes = {"rpc.system": "superfluid", "rpc.method": "Generate"}
            record.trace = self.tracing.begin("Generate", record.started, attributes=attributes)
        with following(record):
            try:
                await self._run(request, record)
            except (ConnectionError, asyncio.CancelledError):  # the client went away mid-stream
                record.disconnected = True
                raise

    async def _run(self, request: Request.Generate, record: AccessRecord) -> None:
        try:
            generation = await self.daemon.generate(request, provisional=False)
        except REFUSED as e:
            refused = refusal(e)
            if self.forwarder is None or not self._forwardable(refused):
                record.refused = True
                await self.send(refused)
                return
            async for reply in self.forwarder.generate(request, refused):
                record.refused = not isinstance(reply, (Response.Delta, Response.Generated))
                await self.send(reply)
            return
        self._generation = generation
        try:
            async for outcome in generation:
                if isinstance(outcome, Committed):
                    await self.send(Response.Delta(outcome.event))
                elif isinstance(outcome, Done):
                    await self.send(
                        Response.Generated(
                            outcome.events, outcome.tokens_generated, outcome.finish, outcome.warm_prefix
                        )
                    )
        finally:
            self._generation = None

    async def _subscribe(self, request: Request.Subscribe) -> None:
        try:
            sub = self.daemon.subscribe(request.session, request.cursor, request.provisional)
        except REFUSED as e:
            await self.send(refusal(e))
            return
        await self.send(Response.Subscribed(sub.id))
        self._subs[sub.id] = (sub, asyncio.create_task(self._pump(sub)))

    async def _pump(self, sub: Subscription) -> None:
        async for item in sub.items():
            if isinstance(item, Committed):
                await self.send(Response.SubEvent(sub.id, item.event))
            elif isinstance(item, SubEnded):
                self._subs.pop(sub.id, None)
                await self.send(Response.SubEnded(sub.id, item.reason))
            else:
                await self.send(Response.SubProvisional(sub.id, item.channel, item.text))

    async def _unsubscribe(self, request: Request.Unsubscribe) -> None:
        entry = self._subs.get(request.sub)
        if entry is None:
            await self.send(Response.Err(f"no subscription {request.sub} on this connection"))
            return
        self.daemon.bus.end(entry[0], END_UNSUBSCRIBED)
        await self.send(Response.Unsubscribed())

    async def close(self) -> None:
        """The client went away: stop its generation and detach its subscriptions."""
        if self._generation is not None:
            self._generation.cancel()
        for sub, task in list(self._subs.values()):
            self.daemon.bus.detach(sub)
            task.cancel()
        self._subs.clear()
