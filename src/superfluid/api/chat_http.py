"""What the OpenAI, Anthropic and Ollama routes share about running a chat over HTTP.

A request's scheduling class comes from its `x-superfluid-qos` header (interactive,
completion, agent, background), else from `--http-default-qos`; `x-superfluid-batch-invariant`
asks for a lane that runs alone, which the listener grants only with
`--http-allow-batch-invariant`. A non-streaming reply is collected while the ASGI receive
channel is watched: a client that hangs up before its reply is ready gets its generation
cancelled at the next tick, as a streaming client does when its stream is closed.
`--nonstream-keepalive` sends such a reply's headers at once and spaces until its body.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ..core.daemon import Daemon
from ..core.runtime import ModelError, Runtime
from ..protocol.schema import QOS_AGENT, QOS_NAMES, qos_class
from ..transports.access import request_key
from .chat import ChatError, ChatRun, Collected

QOS_HEADER = "x-superfluid-qos"
INVARIANT_HEADER = "x-superfluid-batch-invariant"

T = TypeVar("T")


@dataclass(frozen=True)
class HttpPolicy:
    """How the HTTP listener schedules what it is sent."""

    default_qos: int = QOS_AGENT
    qos_header: bool = True  # False: every request runs in default_qos, whatever it claims
    allow_batch_invariant: bool = False
    nonstream_keepalive: float = 0.0  # seconds between the spaces of a non-streaming body; 0 off
    shed_when_busy: int | None = None  # the status of a stateless request while every lane is busy; None: queue


def model_id_for(daemon: Daemon, name: str | None) -> str:
    """The id of the model a request names; ChatError 404, listing the known ones, for one not known here."""
    model_id = daemon.models.find(name)
    if model_id is None:
        known = ", ".join(daemon.models.known)
        raise ChatError(f"model {name!r} is not served here; known models: {known}", 404, "model_not_found")
    return model_id


def problems(errors: Iterable[Mapping[str, Any]], skip: int = 0) -> str:
    """pydantic's validation errors in one line: each field's dotted path (less its first `skip` parts,
    FastAPI's "body") and what is wrong with it."""
    return "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ())[skip:]) or 'body'}: {e.get('msg')}" for e in errors)


FORWARD_STATE = "superfluid_forward"  # in a request's scope state: the listener may send it on to another daemon


def may_forward(request: Request) -> bool:
    """Whether a request for a session another daemon serves may be sent on to that daemon (the HTTP
    listener says so for the routes it forwards): raising SessionElsewhere hands it to the listener."""
    return bool(request.scope.get("state", {}).get(FORWARD_STATE))


def owner(request: Request) -> str | None:
    """Who stores what a request stores: its key's name under a key policy (each key sees only its
    own), None otherwise."""
    key = request_key(request.scope)
    return key.name if key is not None else None


async def runtime_for(daemon: Daemon, name: str | None) -> Runtime:
    """The loaded model a request names (loading it if need be); ChatError 404 for one not known here."""
    model_id = model_id_for(daemon, name)
    try:
        return await asyncio.to_thread(daemon.models.runtime, model_id)
    except ModelError as e:
        raise ChatError(str(e), e.status, "model_load_failed") from None


def scheduling(request: Request, policy: HttpPolicy) -> tuple[int, bool]:
    """The (QoS class, batch invariant) a request runs with; ChatError for a header it may not use.

    A key from `--key-policy` brings its own class, the most urgent class it may claim, and
    whether it may ask for batch invariance."""
    key = request_key(request.scope)
    qos = key.qos if key is not None else policy.default_qos
    claimed = request.headers.get(QOS_HEADER)
    if claimed and policy.qos_header:
        try:
            qos = qos_class(claimed)
        except ValueError as e:
            raise ChatError(f"{QOS_HEADER}: {e}") from None
        if key is not None and qos < key.max_qos:
            raise ChatError(
                f"{QOS_HEADER}: key {key.name!r} may claim {QOS_NAMES[key.max_qos]} at most, not {claimed}",
                status=403,
                code="qos_not_allowed",
            )
    invariant = request.headers.get(INVARIANT_HEADER, "").strip().lower() in ("1", "true", "yes")
    allowed = policy.allow_batch_invariant or (key is not None and key.batch_invariant)
    if invariant and not allowed:
        raise ChatError(
            f"{INVARIANT_HEADER} is refused on this listener; start superfluid with --http-allow-batch-invariant",
            status=403,
            code="permission_denied",
        )
    return qos, invariant


async def _hang_up(request: Request) -> None:
    """Returns when the client closes its connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(run: ChatRun, request: Request | None) -> Collected | None:
    """The whole reply of `run`, or None (and the generation cancelled) when the client went away first."""
    return await while_connected(run.collect(), [run], request)


async def collect_all(runs: Sequence[ChatRun], request: Request | None) -> list[Collected] | None:
    """The whole replies of runs generated side by side (one request's choices), or None as `collect`."""
    return await while_connected(asyncio.gather(*(run.collect() for run in runs)), runs, request)


async def while_connected(work: Awaitable[T], runs: Sequence[ChatRun], request: Request | None) -> T | None:
    """`work`'s result, or None (and `runs` cancelled) when the client hangs up first; with no request
    (a batch's, which no client waits on), simply `work`'s result."""
    if request is None:
        return await work
    reply = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_hang_up(request))
    try:
        await asyncio.wait({reply, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the response itself was abandoned (a keep-alive body's client left)
        reply.cancel()
        for run in runs:
            run.cancel()
        raise
    finally:
        gone.cancel()
    if reply.done():
        return reply.result()
    reply.cancel()  # leaving the runs' pieces cancels their generations
    for run in runs:
        run.cancel()
    return None


KEEPALIVE_HEADER = "x-superfluid-keepalive"


async def answer(policy: HttpPolicy, build: Callable[[], Awaitable[Response]]) -> Response:
    """A non-streaming reply. With `--nonstream-keepalive`, the status and headers go out at
    once and a space every interval keeps the body alive until the JSON is ready (JSON
    allows leading whitespace); a client that hangs up meanwhile has its generation cancelled."""
    if policy.nonstream_keepalive <= 0:
        return await build()

    async def body() -> AsyncIterator[bytes]:
        built = asyncio.ensure_future(build())
        try:
            while True:
                done, _ = await asyncio.wait({built}, timeout=policy.nonstream_keepalive)
                if done:
                    break
                yield b" "
            yield bytes(built.result().body)
        finally:
            built.cancel()

    return StreamingResponse(body(), media_type="application/json", headers={KEEPALIVE_HEADER: "whitespace"})
