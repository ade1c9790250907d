"""The main HTTP listener (`--http`): OpenAI, Anthropic and Ollama routes on one port.

On a loopback listener it also serves the browser UI and its session API (`web.py`'s /web/*
routes, behind the web token rather than the API keys), so `http://127.0.0.1:8453/` opens
the UI in a browser: a page asking for `/` is sent to `/web/`, signed in at once when the API
takes no key (whoever can reach the API may use the sessions anyway), and to sign in with the
token printed at start otherwise.

Also `GET /health`, `GET /metrics`, embeddings (`embeddings.py`), the status and
tokenizer routes (`status.py`), and OpenAI's files and batches (`files.py`, `batches.py`:
the batches' runner starts and stops with this listener). Keys, rate limits and draining
are `access.py`'s. Every request, refused ones included, has an access line
(`telemetry/access_log.py`), and with `--otlp-endpoint` a trace.
Requests from a web page of another site are
refused (an `Origin` that is not this machine gets 403) unless `--cors-origin` lists it
(`cors.py`), and a loopback listener answers only loopback `Host` names, so a page cannot
reach it through DNS rebinding.
"""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Send
from starlette.types import Scope as ASGIScope

from ..api import (
    anthropic,
    anthropic_errors,
    batches,
    embeddings,
    files,
    infill,
    models,
    ollama,
    openai,
    responses,
    status,
)
from ..api.chat_http import FORWARD_STATE, HttpPolicy, problems
from ..core.daemon import Daemon
from ..core.errors import SessionElsewhere
from ..telemetry.access_log import AccessLog
from .access import GLOBAL_KEY, REFUSED_KEY, STATE_KEY, AccessGate, Key, Scope
from .addresses import split_address
from .cors import Cors, CorsOrigins
from .forward import Forwarder, forwarded
from .listener import HttpListener
from .web import create_app as create_web_app
from .web import own_origins

if TYPE_CHECKING:  # the SDK loads with tracing only
    from ..telemetry.tracing import Tracing

BODY_LIMIT = 100 << 20
# routes that may need a session another daemon of the store serves (a chain of responses), and
# are sent on to it; /web/rpc and /web/stream forward on their own (web.py)
FORWARDED_ROUTES = frozenset({"/v1/responses"})
# routes whose requests carry no session, which any daemon may answer: with --shed-when-busy, refused
# while every lane is busy, so that they go to another daemon rather than queue here
SHED_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/messages", "/api/chat", "/api/generate"})


def _busy(daemon: Daemon) -> bool:
    """Whether every lane of every loaded model is busy (a daemon serves one model, mostly)."""
    loaded = daemon.models.loaded()
    return bool(loaded) and all(runtime.scheduler.busy() for runtime in loaded)


def _loopback_name(host: str) -> bool:
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(value: str) -> str:
    """The host part of a Host header or an Origin URL."""
    value = value.split("://", 1)[-1].split("/", 1)[0]
    if value.startswith("["):
        return value[: value.index("]") + 1]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """What every request to the main port passes before its route: an `Origin` of another site (unless
    `--cors-origin` lists it), a `Host` that is not a loopback name on a loopback listener, a body over
    `BODY_LIMIT` and, with `--shed-when-busy`, a request while every lane is busy, are refused; a request
    that may need a session another daemon serves goes there when the route finds it elsewhere.

    It is plain ASGI: a streamed reply's chunks go straight on to the server (Starlette's function
    middleware passed each one through a task and a memory stream of its own)."""

    def __init__(
        self,
        app: ASGIApp,
        daemon: Daemon,
        loopback: bool,
        policy: HttpPolicy,
        cors: CorsOrigins | None,
        forwarder: Forwarder | None,
    ) -> None:
        self.app = app
        self.daemon, self.loopback, self.policy, self.cors, self.forwarder = daemon, loopback, policy, cors, forwarder

    def _refusal(self, request: Request) -> Response | None:
        def refuse(message: str, status: int, code: str) -> Response:
            if anthropic_errors.is_anthropic(request.url.path):
                return anthropic.error(message, status)
            return openai.error(message, status, code)

        origin = request.headers.get("origin")
        if origin and not _loopback_name(_host_of(origin)) and not (self.cors and self.cors.allows(origin)):
            return refuse(f"origin {origin} is not this machine", 403, "origin_refused")
        host = request.headers.get("host", "")
        if self.loopback and host and not _loopback_name(_host_of(host)):
            return refuse(f"host {host} is not a loopback name", 403, "host_refused")
        length = request.headers.get("content-length")
        if length and length.isdigit() and int(length) > BODY_LIMIT:
            return refuse(f"request body is over the {BODY_LIMIT}-byte limit", 413, "payload_too_large")
        shed = self.policy.shed_when_busy
        if shed and request.method == "POST" and request.url.path in SHED_ROUTES and _busy(self.daemon):
            refused = refuse("every lane is busy: try again, or another daemon", shed, "busy")
            refused.headers["Retry-After"] = "1"
            return refused
        return None

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        refused = self._refusal(request)
        if refused is not None:
            await refused(scope, receive, send)
            return
        if self.forwarder is None or request.url.path not in FORWARDED_ROUTES or forwarded(request):
            await self.app(scope, receive, send)
            return
        body = await request.body()  # kept for the owner; the route reads it again from `replayed`
        scope.setdefault("state", {})[FORWARD_STATE] = True
        read = False

        async def replayed() -> Message:
            nonlocal read
            if read:
                return await receive()
            read = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replayed, send)
        except SessionElsewhere as e:  # raised before the route answered anything
            await (await self.forwarder.send(request, body, e.api))(scope, receive, send)


def create_app(
    daemon: Daemon,
    loopback: bool,
    policy: HttpPolicy,
    runner: batches.BatchRunner,
    cors: CorsOrigins | None = None,
    web: FastAPI | None = None,
    page: str = "/web/",
    forwarder: Forwarder | None = None,
) -> FastAPI:
    """The routes of the main port; with `web`, the browser UI's too, and a browser asking for `/`
    sent to `page`; with a `forwarder`, a request for a session another daemon serves answered by it."""
    app = FastAPI(title="superfluid", docs_url=None, redoc_url=None)

    app.add_middleware(Guard, daemon=daemon, loopback=loopback, policy=policy, cors=cors, forwarder=forwarder)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        wrong = problems(exc.errors(), skip=1)  # less FastAPI's "body"
        if request.url.path.startswith("/api/"):
            return ollama.error(wrong)
        if anthropic_errors.is_anthropic(request.url.path):
            return anthropic.error(wrong)
        return openai.error(wrong)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models_loaded": len(daemon.models.loaded()), "models_known": len(daemon.models.known)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return PlainTextResponse(daemon.metrics.exposition(), media_type="text/plain; version=0.0.4")

    if web is not None:
        app.include_router(web.router)

        @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
        async def index(request: Request) -> Response:
            if "text/html" in request.headers.get("accept", ""):
                return RedirectResponse(page, status_code=302)
            return PlainTextResponse("superfluid is running")  # what clients probing the root expect

    app.include_router(models.router(daemon))
    app.include_router(openai.router(daemon, policy))
    app.include_router(infill.router(daemon, policy))
    app.include_router(responses.router(daemon, policy))
    app.include_router(anthropic.router(daemon, policy))
    app.include_router(ollama.router(daemon, policy))
    app.include_router(embeddings.router(daemon))
    app.include_router(status.router(daemon))
    app.include_router(files.router(daemon, runner.reading))
    app.include_router(batches.router(runner))
    return app


class ApiServer(HttpListener):
    """The OpenAI, Anthropic and Ollama routes on `--http`, behind the keys and limits of `gate`."""

    def __init__(
        self,
        daemon: Daemon,
        address: str,
        policy: HttpPolicy,
        api_key: str | None = None,
        keys: list[Key] | None = None,
        rate_limit_rpm: int = 0,
        cors_origins: list[str] | None = None,
        web_token: str | None = None,
        forwarder: Forwarder | None = None,
        tracing: Tracing | None = None,
    ) -> None:
        host, port = split_address(address)
        loopback = _loopback_name(host)
        cors = CorsOrigins(cors_origins or [])
        keyed = bool(api_key or keys)
        # the UI on this port: loopback only, as `--web`; signed in at once where the API takes no key
        self.web = create_web_app(daemon, web_token, [], forwarder, tracing) if web_token and loopback else None
        self.page = f"/web/#token={web_token}" if web_token else "/web/"
        # batches start no new request while the listener drains
        self.batches = batches.BatchRunner(daemon, lambda: self.gate.draining)
        app = create_app(
            daemon, loopback, policy, self.batches, cors, self.web, "/web/" if keyed else self.page, forwarder
        )
        self.gate = AccessGate(app, api_key, keys or [], rate_limit_rpm)
        daemon.metrics.watch_gate(self.gate)
        # outside the keys: a preflight carries none, and a page must be able to read a 401; the access
        # log outside everything, so that refusals have their lines too
        app_with_cors = Cors(self.gate, cors) if cors else self.gate
        super().__init__(AccessLog(app_with_cors, tracing, self.key_name), host, port, "the HTTP API")
        self.loopback = loopback

    def key_name(self, scope: Scope) -> str | None:
        """The name of the key a request came with; None with keys off, or without a valid key."""
        state = scope.get("state", {})
        if STATE_KEY not in state:
            return state.get(REFUSED_KEY)
        key = state[STATE_KEY]
        return key.name if key is not None else GLOBAL_KEY if self.gate.keyed else None

    async def start(self) -> str:
        await self.batches.start()  # before the routes answer: they read the batches it loads
        try:
            url = await super().start()
        except BaseException:
            await self.batches.stop()
            raise
        if self.web is not None:
            self.web.state.auth.origins.update(own_origins(int(url.rsplit(":", 1)[1])))
        return url

    async def stop(self) -> None:
        await self.batches.stop()
        await super().stop()

    def page_url(self, url: str) -> str | None:
        """The address that opens the browser UI signed in, when this port serves it."""
        return f"{url}{self.page}" if self.web is not None else None
