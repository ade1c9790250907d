"""The browser transport (`--web`): the session API as JSON over HTTP and WebSocket.

Routes: `POST /web/rpc` (one request, one reply), `POST /web/stream` (a generation as
server-sent events), `GET /web/ws` (a WebSocket carrying every request, streaming ones
included), `GET /web/health`, and `GET /web/` with its two files: the browser UI, a static
page that signs in with the token in its address's fragment (`/web/#token=...`, which the
browser never sends) and then uses /web/ws only; the page's own origin is allowed there. The
listener binds loopback only and every route but health and the page needs the token minted
at start into `<sessions>/web-token` (mode 0600):

- /web/rpc and /web/stream: `Authorization: Bearer <token>` (401 otherwise), any
  `Origin` listed by --web-origin and `X-Superfluid-CSRF: <token>` (403 otherwise);
- /web/ws: the token as Bearer or as a `superfluid.token.<token>` subprotocol (401), an
  `Origin` that is listed (403), and `superfluid.v1` among the offered subprotocols (400).

No CORS headers are sent, so a web page can reach only /web/ws. Request bodies over
2 MiB get 413. A `Complete` past the listener's bucket gets 429 with `Retry-After`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request as HttpRequest
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from ..core.constraints import ConstraintError, constraint_grammar
from ..core.daemon import Daemon
from ..core.errors import REFUSED, refusal
from ..core.generation import Committed, Done, Provisional
from ..core.verbs.generate import STREAMED
from ..model.tools import ToolDeclarationError, normalize_tool
from ..protocol import jsoncodec
from ..protocol.schema import Request
from ..protocol.schema import Response as Reply
from ..protocol.types import U32, U64, Struct
from ..telemetry.access_log import AccessLog
from .addresses import LOOPBACK_HOSTS, parse_web_address
from .connection import Connection
from .forward import Forwarder, forwarded
from .listener import HttpListener
from .ratelimit import TokenBucket, retry_after_header, retry_after_ms

if TYPE_CHECKING:  # the SDK loads with tracing only
    from ..telemetry.tracing import Tracing

log = logging.getLogger("superfluid.web")

PROTOCOL = "superfluid.v1"
TOKEN_PROTOCOL = "superfluid.token."
BODY_LIMIT = 2 << 20
WS_INBOUND_QUEUE = 32
KEEPALIVE_S = 15.0
OWNER_HEADER = "X-Superfluid-Session-Owner"  # on a 409: the address of the daemon serving the session
STREAMING_ON_RPC = "streaming verbs use the WebSocket surface (/web/ws) or SSE (/web/stream), not /web/rpc"
PAGE = Path(__file__).resolve().parent.parent / "views" / "web"
PAGE_FILES = {
    "": ("index.html", "text/html"),
    "app.js": ("app.js", "text/javascript"),
    "app.css": ("app.css", "text/css"),
}
# the page loads only its own files and talks only to its own origin's /web/ws
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


class StreamRequest(Struct):
    """The body of POST /web/stream.

    Beyond the protocol's three fields the body may carry `ignore_eos` (decode to
    `max_tokens`), `every_event` (every event the generation commits, its opener included, as the
    socket's Deltas carry them) and one constraint: `grammar` (GBNF text), `json_schema` (an object)
    or `tool` (a tool declaration the reply must call).
    """

    session: U64
    max_tokens: U32
    provisional: bool | None
    ignore_eos: bool | None = None
    every_event: bool | None = None


def mint_token(path: Path, shared: str | None = None) -> str:
    """A fresh token (32 random bytes as 64 hex digits), or the one all daemons sharing a store take
    (so a client sent from one to another signs in there too), written with mode 0600."""
    token = shared or os.urandom(32).hex()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return token


def _err(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"Err": {"message": message}}, status_code=status, headers=headers)


def _same(presented: str, token: str) -> bool:
    return len(presented) == len(token) and hmac.compare_digest(presented.encode(), token.encode())


class WebAuth:
    """The token and Origin checks, in the order the protocol gives them."""

    def __init__(self, token: str, origins: list[str]) -> None:
        self.token = token
        self.origins = set(origins)

    def _bearers(self, headers: Any) -> list[str] | None:
        """Tokens of the Authorization headers; None if one is not `Bearer <token>`."""
        tokens = []
        for value in headers.getlist("authorization"):
            if not value.startswith("Bearer "):
                return None
            tokens.append(value[len("Bearer ") :])
        return tokens

    def http(self, request: HttpRequest) -> JSONResponse | None:
        bearers = self._bearers(request.headers)
        if not bearers or not all(_same(t, self.token) for t in bearers):
            return _err(401, "bad or missing bearer token")
        if not all(origin in self.origins for origin in request.headers.getlist("origin")):
            return _err(403, "origin not allowed")
        csrf = request.headers.getlist("x-superfluid-csrf")
        if not csrf or not all(_same(t, self.token) for t in csrf):
            return _err(403, "missing or bad CSRF token")
        return None

    def websocket(self, websocket: WebSocket, offered: list[str]) -> JSONResponse | None:
        bearers = self._bearers(websocket.headers)
        presented = (bearers or []) + [p[len(TOKEN_PROTOCOL) :] for p in offered if p.startswith(TOKEN_PROTOCOL)]
        if bearers is None or not presented or not all(_same(t, self.token) for t in presented):
            return _err(401, "bad or missing bearer token")
        origins = websocket.headers.getlist("origin")
        if not origins:
            return _err(403, "missing Origin (required on /web/ws)")
        if not all(origin in self.origins for origin in origins):
            return _err(403, "origin not allowed")
        if offered and PROTOCOL not in offered:
            return _err(400, "offer the superfluid.v1 subprotocol")
        return None


def _offered(websocket: WebSocket) -> list[str]:
    return [
        item.strip()
        for header in websocket.headers.getlist("sec-websocket-protocol")
        for item in header.split(",")
        if item.strip()
    ]


async def _json_body(request: HttpRequest) -> Any:
    """The parsed JSON body, or the error response to send instead."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        return _err(415, "send the body as JSON with Content-Type: application/json")
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > BODY_LIMIT:
        return _err(413, f"request body of {declared} bytes is over the {BODY_LIMIT}-byte limit")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > BODY_LIMIT:
            return _err(413, f"request body is over the {BODY_LIMIT}-byte limit")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _err(400, f"invalid JSON body: {e}")
    except RecursionError:
        return _err(400, "invalid JSON body: nested too deeply")


def own_origins(port: int) -> list[str]:
    """The origins the UI page has when this listener serves it on `port`."""
    return [f"http://{host}:{port}" for host in LOOPBACK_HOSTS]


def create_app(
    daemon: Daemon,
    token: str,
    origins: list[str],
    forwarder: Forwarder | None = None,
    tracing: Tracing | None = None,
) -> FastAPI:
    """The /web/* routes over one daemon; with a `forwarder`, a request for a session another daemon
    serves is answered by that daemon (`forward.py`) rather than refused with its address; with `tracing`,
    each WebSocket generation is traced."""
    app = FastAPI(title="superfluid session API (browser transport)", docs_url=None, redoc_url=None)
    auth = WebAuth(token, origins)
    app.state.auth = auth
    rpc_bucket = TokenBucket()

    @app.get("/web/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/web")
    async def page_root() -> Response:
        return RedirectResponse("/web/", status_code=308)

    @app.get("/web/{name:path}")
    async def page(name: str) -> Response:
        found = PAGE_FILES.get(name)
        if found is None:
            return _err(404, f"no page file {name!r}: the UI is at /web/")
        filename, media_type = found
        return FileResponse(PAGE / filename, media_type=media_type, headers=PAGE_HEADERS)

    async def checked(request: HttpRequest, tp: Any, what: str) -> tuple[Any, Any] | Response:
        """The body, parsed and decoded as `tp`, or the response refusing the request."""
        refused = auth.http(request)
        if refused is not None:
            return refused
        body = await _json_body(request)
        if isinstance(body, Response):
            return body
        try:
            return body, jsoncodec.from_json(body, tp)
        except jsoncodec.JsonShapeError as e:
            return _err(422, f"invalid {what}: {e}")
        except RecursionError:
            return _err(422, f"invalid {what}: nested too deeply")

    async def elsewhere_or(request: HttpRequest, body: Any, reply: Any) -> Response:
        """The reply; for a session another daemon serves, that daemon's answer where it can be asked."""
        if (
            isinstance(reply, Reply.Elsewhere)
            and forwarder is not None
            and not forwarded(request)
            and forwarder.reaches(reply.address)
        ):
            return await forwarder.send(request, json.dumps(body).encode(), reply.address)
        return _reply(reply)

    @app.post("/web/rpc")
    async def rpc(request: HttpRequest) -> Response:
        parsed = await checked(request, Request, "request")
        if isinstance(parsed, Response):
            return parsed
        body, call = parsed
        if isinstance(call, (Request.Generate, Request.Subscribe, Request.Unsubscribe)):
            return _reply(Reply.Err(STREAMING_ON_RPC))
        if isinstance(call, Request.Complete) and (wait := rpc_bucket.take()):
            return JSONResponse(
                jsoncodec.to_json(Reply.Throttled(retry_after_ms(wait))),
                status_code=429,
                headers={"Retry-After": retry_after_header(wait)},
            )
        return await elsewhere_or(request, body, await daemon.request(call))

    @app.post("/web/stream")
    async def stream(request: HttpRequest) -> Response:
        parsed = await checked(request, StreamRequest, "stream request")
        if isinstance(parsed, Response):
            return parsed
        body, ask = parsed
        if daemon.store.leases is not None:
            try:
                daemon.store.get(ask.session)  # served here from now on, unless another daemon serves it
            except REFUSED as e:
                return await elsewhere_or(request, body, refusal(e))
        try:
            tool = body.get("tool")
            function = normalize_tool(tool)["function"] if tool else None
            grammar = constraint_grammar(
                daemon.template,
                gbnf=body.get("grammar"),
                json_schema=body.get("json_schema"),
                tools=[(function["name"], function["parameters"])] if function else None,
            )
        except (ConstraintError, ToolDeclarationError) as e:
            return _err(422, f"invalid stream request: {e}")
        return StreamingResponse(
            _sse(daemon, ask, grammar),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    @app.websocket("/web/ws")
    async def ws(websocket: WebSocket) -> None:
        offered = _offered(websocket)
        refused = auth.websocket(websocket, offered)
        if refused is not None:
            await websocket.send_denial_response(refused)
            return
        await websocket.accept(subprotocol=PROTOCOL if offered else None)
        await _serve_websocket(daemon, websocket, forwarder, tracing)

    return app


def _reply(reply: Any) -> Response:
    """A reply as JSON; a session another daemon serves is a 409 whose header names that daemon."""
    if isinstance(reply, Reply.Elsewhere):
        headers = {OWNER_HEADER: reply.address}
        return Response(jsoncodec.dumps(reply, Reply), 409, headers=headers, media_type="application/json")
    return Response(jsoncodec.dumps(reply, Reply), media_type="application/json")


async def _sse(daemon: Daemon, ask: StreamRequest, grammar: str | None) -> AsyncIterator[str]:
    """One generation as SSE frames; the client going away cancels it."""
    try:
        generate = Request.Generate(ask.session, ask.max_tokens, ask.ignore_eos)
        generation = await daemon.generate(generate, provisional=bool(ask.provisional), grammar=grammar)
    except REFUSED as e:
        yield jsoncodec.sse({"error": str(e)})
        yield "data: [DONE]\n\n"
        return
    ended = False
    try:
        while True:
            outcome = await generation.next(timeout=KEEPALIVE_S)
            if outcome is None:
                yield ": keep-alive\n\n"
            elif isinstance(outcome, Provisional):
                yield jsoncodec.sse({"provisional": {"channel": outcome.channel, "text": outcome.text}})
            elif isinstance(outcome, Committed):
                if ask.every_event or isinstance(outcome.event.body, STREAMED):
                    yield jsoncodec.sse({"committed": jsoncodec.to_json(outcome.event)})
            elif isinstance(outcome, Done):
                ended = True
                if outcome.error is not None:
                    yield jsoncodec.sse({"error": outcome.error})
                else:
                    done = {"tokens_generated": outcome.tokens_generated, "finish": outcome.finish}
                    yield jsoncodec.sse({"done": {**done, "warm_prefix": outcome.warm_prefix}})
                break
        yield "data: [DONE]\n\n"
    finally:
        if not ended:
            generation.cancel()


async def _serve_websocket(
    daemon: Daemon, websocket: WebSocket, forwarder: Forwarder | None, tracing: Tracing | None
) -> None:
    """Requests in order, one reply per text frame; bad frames get an Err and the socket stays open."""
    send_lock = asyncio.Lock()

    async def send(reply: Any) -> None:
        async with send_lock:
            await websocket.send_text(jsoncodec.dumps(reply, Reply))

    connection = Connection(daemon, send, forwarder, "ws", tracing)
    inbound: asyncio.Queue[Any] = asyncio.Queue(WS_INBOUND_QUEUE)

    async def read() -> None:
        while True:
            message = await websocket.receive()
            if message["type"] == "websocket.disconnect":
                raise WebSocketDisconnect(message.get("code", 1000))
            data = message.get("text")
            if data is None:
                data = message.get("bytes") or b""
            try:
                await inbound.put(jsoncodec.loads(data, Request))
            except jsoncodec.JsonShapeError as e:
                await inbound.put(Reply.Err(f"invalid request frame: {e}"))

    async def work() -> None:
        while True:
            item = await inbound.get()
            if isinstance(item, Reply.Err):
                await send(item)
            else:
                await connection.handle(item)

    reader = asyncio.create_task(read())
    worker = asyncio.create_task(work())
    try:
        await asyncio.wait({reader, worker}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (reader, worker):
            task.cancel()
        await connection.close()
        for task in (reader, worker):
            with contextlib.suppress(BaseException):
                await task


class WebServer(HttpListener):
    """The /web/* app on a loopback address (any address for daemons sharing a store), each request with its
    access line (`telemetry/access_log.py`)."""

    def __init__(
        self,
        daemon: Daemon,
        address: str,
        token: str,
        origins: list[str],
        anywhere: bool = False,
        forwarder: Forwarder | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        host, port = parse_web_address(address, anywhere)
        self.token = token
        self.app = create_app(daemon, token, origins, forwarder, tracing)
        super().__init__(AccessLog(self.app, tracing), host, port, "the browser transport")

    async def start(self) -> str:
        url = await super().start()
        self.app.state.auth.origins.update(own_origins(int(url.rsplit(":", 1)[1])))
        return url

    def page_url(self, url: str) -> str:
        """The address that opens the UI signed in."""
        return f"{url}/web/#token={self.token}"
