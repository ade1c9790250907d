"""The access log: a line per HTTP request, and per generation on the socket or the WebSocket.

Lines go to the logger `superfluid.access` (`--log-filter superfluid.access=off` silences them), at info,
or at debug for health checks and scrapes (`QUIET_PATHS`). The text log shows one as

    POST /v1/chat/completions 200 model=SmolLM2-135M-Instruct qos=agent session=3 prompt_tokens=36 ...

and the JSON log (`--log-dir`) carries the same fields as keys of its line. A line names the key a request
came with, never its secret, and counts tokens, never their text.

An `AccessRecord` follows one request. The transport makes it current (a context variable, so the
generate verb and the forwarder, deeper down the same request, find it without being handed it); a
generation started under it is attached (`attach`), and the line is written once the request has ended
and each of its generations has concluded, whichever comes last: a client that hangs up ends its request
before its cancelled generation ends. With tracing on, the record carries the request's root span, and
its line the trace id.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..protocol.schema import FINISH_NAMES, FINISH_STOP, QOS_NAMES
from ..scheduler.job import JobTimes

if TYPE_CHECKING:  # the SDK and starlette load only with tracing on and with the HTTP listeners
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

    from ..core.generation import GenerationRun
    from .tracing import RequestTrace, Tracing

log = logging.getLogger("superfluid.access")

QUIET_PATHS = frozenset({"/health", "/metrics", "/v1/metrics", "/web/health"})  # logged at debug, never traced

_current: ContextVar[AccessRecord | None] = ContextVar("superfluid_access_record", default=None)


def current() -> AccessRecord | None:
    """The record of the request the calling code runs for; None outside one (a batch, a warm-up)."""
    return _current.get()


@dataclass(frozen=True)
class Served:
    """A generation a request started: its run, the model it ran on, and its prompt's length then."""

    run: GenerationRun
    model: str
    prompt_tokens: int


@dataclass(frozen=True)
class Hop:
    """A request sent on to the daemon that owns its session: the headers that carry its trace there, and
    what to call once the owner's answer has been relayed."""

    headers: dict[str, str]
    end: Callable[[], None]


class AccessRecord:
    """One HTTP request, or one socket or WebSocket generation, from its arrival to its line."""

    def __init__(self, transport: str, method: str, route: str = "") -> None:
        self.transport = transport  # http, socket or ws
        self.method = method  # the HTTP method, or the session API's verb
        self.route = route  # the route's path template (the path itself when none matched)
        self.started = time.time_ns()
        self.ended = 0
        self.status: int | None = None  # HTTP
        self.refused = False  # socket and WebSocket: the daemon refused the verb
        self.key: str | None = None
        self.session: int | None = None  # a refused verb's session, which no generation names
        self.forwarded_to: str | None = None
        self.disconnected = False  # the client went away before the whole answer was sent
        self.served: list[Served] = []
        self.stop_string = False  # the API cut a reply at a stop string, and cancelled what it generated past it
        self.trace: RequestTrace | None = None
        self.quiet = route in QUIET_PATHS
        self._waiting = 1  # the request itself, and each attached generation until it concludes
        self._lock = threading.Lock()

    def finish(self, served: Served) -> str | None:
        """How a generation ended, as the client was told: a reply cut at a stop string stopped, whether the run
        ended by the cancel that followed the cut or before it."""
        finish = served.run.finish
        if finish is None:
            return None
        return FINISH_NAMES[FINISH_STOP if self.stop_string else finish]

    def attach(self, run: GenerationRun, model: str) -> None:
        """Follow a generation this request starts (before it is submitted: its job's times are stamped)."""
        with self._lock:
            if self._waiting == 0:  # the line is written: a task the request left behind generates on its own
                return
            self._waiting += 1
            self.served.append(Served(run, model, len(run.job.tokens)))
        run.job.times = JobTimes(chunks=[] if self.trace is not None else None)
        run.on_done = self._concluded

    def hop(self, owner: str) -> Hop:
        """The request goes on to the daemon at `owner`: the headers to send there, and its end to call."""
        self.forwarded_to = owner
        return self.trace.hop(owner) if self.trace is not None else Hop({}, lambda: None)

    def end(self) -> None:
        """The request is answered, or its client is gone."""
        self.ended = time.time_ns()
        self._release()

    def _concluded(self, run: GenerationRun) -> None:
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._waiting -= 1
            last = self._waiting == 0
        if last:
            try:
                self._write()
            except Exception:  # on the committer thread too: a line that fails must not stop the commits
                log.exception("writing an access line failed")

    def _write(self) -> None:
        fields = self.fields()
        if self.trace is not None:
            self.trace.end(self, fields)
        # the text begins with what the request was, then gives the rest that applies as name=value
        head = ("method", "route", "status") if self.transport == "http" else ("transport", "verb", "result")
        text = " ".join(str(fields[name]) for name in head)
        text += "".join(
            f" {name}={_value(value)}"
            for name, value in fields.items()
            if value is not None and name not in head and name != "transport"
        )
        log.log(logging.DEBUG if self.quiet else logging.INFO, text, extra={"fields": fields})

    def fields(self) -> dict[str, Any]:
        """The line's fields, in its order; one that does not apply is None (null in JSON, left out of the text)."""
        fields: dict[str, Any] = {"transport": self.transport}
        if self.transport == "http":
            fields |= {"method": self.method, "route": self.route, "status": self.status}
        else:
            fields |= {"verb": self.method, "result": "refused" if self.refused else "ok"}
        fields |= {"key": self.key, "model": None, "qos": None, "session": self.session}
        fields |= dict.fromkeys(("prompt_tokens", "cached_tokens", "completion_tokens"))
        fields |= dict.fromkeys(("queued_ms", "ttft_ms", "decode_tok_s", "finish"))
        if self.served:
            first = self.served[0]
            run, job, times = first.run, first.run.job, first.run.job.times or JobTimes()
            fields |= {
                "model": first.model,
                "qos": QOS_NAMES.get(job.qos),
                "session": run.session,
                "prompt_tokens": first.prompt_tokens,
                "cached_tokens": job.warm_prefix,
                "completion_tokens": sum(served.run.job.generated for served in self.served),
                "queued_ms": _ms(times.admitted - times.submitted) if times.admitted else None,
                "ttft_ms": _ms(times.first_token - self.started) if times.first_token else None,
                "decode_tok_s": decode_rate(job.generated, times),
                "finish": self.finish(first),
            }
            if len(self.served) > 1:
                fields["generations"] = len(self.served)
        fields |= {"forwarded_to": self.forwarded_to, "duration_ms": _ms(self.ended - self.started)}
        if self.disconnected:
            fields["disconnected"] = True
        if self.trace is not None:
            fields["trace_id"] = self.trace.trace_id
        return fields


def decode_rate(generated: int, times: JobTimes) -> float | None:
    """Tokens a second after the first (which prefill paid for); None with fewer than two tokens."""
    if generated < 2 or times.finished <= times.first_token or not times.first_token:
        return None
    return round((generated - 1) / ((times.finished - times.first_token) / 1e9), 1)


def _ms(nanoseconds: int) -> float:
    return round(nanoseconds / 1e6, 1)


def _value(value: Any) -> str:
    """A field's value in the text line, quoted when it would not read as one word."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return json.dumps(text) if not text or any(c in text for c in ' "=') else text


@contextlib.contextmanager
def following(record: AccessRecord) -> Iterator[AccessRecord]:
    """`record` is the current one while the block runs; it ends with the block."""
    token = _current.set(record)
    try:
        yield record
    finally:
        _current.reset(token)
        record.end()


class AccessLog:
    """ASGI middleware: a current `AccessRecord` for each HTTP request while the app answers it, ended once the
    answer is sent or the client has gone. WebSocket connections pass through: their generations have lines
    of their own. `key_name` says which key a request was let in with (None: keys off, or not let in)."""

    def __init__(
        self,
        app: ASGIApp,
        tracing: Tracing | None = None,
        key_name: Callable[[Scope], str | None] = lambda scope: None,
    ) -> None:
        self.app = app
        self.tracing = tracing
        self.key_name = key_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = AccessRecord("http", scope["method"], scope["path"])
        if self.tracing is not None and not record.quiet:
            record.trace = self.tracing.begin_http(scope, record.started)
        answered = False

        async def receiving() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect" and not answered:
                record.disconnected = True
            return message

        async def sending(message: Message) -> None:
            nonlocal answered
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                answered = True
            await send(message)

        with following(record):
            try:
                await self.app(scope, receiving, sending)
            except BaseException:
                record.status = record.status or 500
                raise
            finally:
                route = scope.get("route")
                record.route = getattr(route, "path", None) or record.route
                record.key = self.key_name(scope)
