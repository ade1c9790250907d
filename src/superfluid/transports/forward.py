"""Requests for a session another daemon serves, sent on to that daemon and its answer streamed back.

Daemons sharing a store lease each session to one of them. A request that needs a session
leased elsewhere would be refused with the owner's address (409, `Elsewhere`), which only our
own client follows; forwarded, it is answered wherever it lands, so any daemon can sit behind
one address. The request goes to the owner's listener (the address its lease names) with its
method, path, body and headers (the key, the QoS class and the token travel with it), marked
`x-superfluid-forwarded` so that it goes one hop at most: a daemon that is not the owner of a
forwarded request's session refuses it as before. The owner's status, headers and body come
back unchanged as they arrive; a client that hangs up closes the forwarded request, which the
owner sees as its own client going away (the generation is cancelled there).

The session API's clients on the socket (and the WebSocket) are served the same way, through
the owner's /web/rpc and /web/stream, with the web token the daemons of a store share:
`Forwarder.call` and `Forwarder.generate` turn a request into the owner's JSON and its answer
back into the protocol's replies. An owner out of reach (dead, or paused, before its lease
runs out) leaves the refusal as it was: `Elsewhere`, which a client retries. The request's access
line names the owner (`forwarded_to`), and when it is traced, the hop is a `forward` span whose
`traceparent` goes to the owner, so the owner's spans join the caller's trace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..protocol import jsoncodec
from ..protocol.schema import EventMsg
from ..protocol.schema import Request as SessionRequest
from ..protocol.schema import Response as Reply
from ..telemetry.access_log import Hop, current

log = logging.getLogger("superfluid.forward")

FORWARDED_HEADER = "x-superfluid-forwarded"
# hop-by-hop headers, and those the new hop sets itself
DROPPED = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "trailer"}
)
CONNECT_TIMEOUT_S = 5.0
# How long the owner may take to answer a session API request before it is taken for paused (a
# SIGSTOP, a VM frozen: its listener still accepts) and the client is told where the session is
# instead: a verb that writes or reads the log answers in milliseconds; a completion or a stream's
# next frame (keep-alives come every 15 s) may take longer.
RPC_TIMEOUT_S = 5.0
GENERATING_TIMEOUT_S = 30.0


def forwarded(request: Request) -> bool:
    """Whether this request came from another daemon (it is not sent on again)."""
    return FORWARDED_HEADER in request.headers


def _headers(headers: Mapping[str, str], **extra: str) -> dict[str, str]:
    kept = {name: value for name, value in headers.items() if name.lower() not in DROPPED}
    return {**kept, **extra}


def _hop(owner: str) -> Hop:
    """The hop of the current request to `owner` (one without an access record is not followed)."""
    record = current()
    return record.hop(owner) if record is not None else Hop({}, lambda: None)


class Forwarder:
    """Sends requests on to the daemons that own their sessions, over one pool of connections."""

    def __init__(self, daemon_id: str, token: str = "") -> None:
        self.daemon_id = daemon_id
        self.token = token  # the web token the daemons of a store share, for the session API's requests
        # no read timeout: a generation's stream may pause as long as the owner's does
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))

    @staticmethod
    def reaches(owner: str) -> bool:
        """Whether an owner's address is one a request can be sent to (a unix socket's is not)."""
        return owner.startswith(("http://", "https://"))

    async def send(self, request: Request, body: bytes, owner: str) -> Response:
        """The owner's answer to `request` (whose `body` was read already); 503 when the owner is out of reach."""
        url = owner.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        hop = _hop(owner)
        outgoing = self._client.build_request(
            request.method,
            url,
            content=body,
            headers=_headers(request.headers, **{FORWARDED_HEADER: self.daemon_id}, **hop.headers),
        )
        try:
            upstream = await self._client.send(outgoing, stream=True)
        except httpx.HTTPError as e:
            hop.end()
            log.warning("forwarding %s %s to %s failed: %s", request.method, request.url.path, owner, e)
            # 503 and Retry-After: a load balancer or a client tries again, and once the owner's lease runs
            # out, the daemon asked takes the session over
            message = f"the daemon serving this session ({owner}) is out of reach ({type(e).__name__}): try again"
            return JSONResponse({"error": {"message": message, "code": "owner_unreachable"}}, 503, {"Retry-After": "1"})
        log.debug("forwarded %s %s to %s: %d", request.method, request.url.path, owner, upstream.status_code)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when our client hangs up: the owner sees its client go
                await upstream.aclose()
                hop.end()

        return StreamingResponse(relay(), upstream.status_code, headers=_headers(upstream.headers))

    def _session_headers(self) -> dict[str, str]:
        return {
            "authorization": f"Bearer {self.token}",
            "x-superfluid-csrf": self.token,
            FORWARDED_HEADER: self.daemon_id,
        }

    async def call(self, request: Any, refused: Any) -> Any:
        """The owner's reply to a session API request that `refused` (an `Elsewhere`) sent there; `refused`
        itself when the owner cannot be asked."""
        try:
            answer = await self._client.post(
                f"{refused.address.rstrip('/')}/web/rpc",
                content=jsoncodec.dumps(request, SessionRequest),
                headers={**self._session_headers(), "content-type": "application/json"},
                timeout=httpx.Timeout(
                    GENERATING_TIMEOUT_S if isinstance(request, SessionRequest.Complete) else RPC_TIMEOUT_S,
                    connect=CONNECT_TIMEOUT_S,
                ),
            )
            return jsoncodec.loads(answer.content, Reply)
        except (httpx.HTTPError, ValueError, jsoncodec.JsonShapeError) as e:
            log.info("could not forward %s to %s: %s", type(request).__name__, refused.address, e)
            return refused

    async def generate(self, request: Any, refused: Any) -> AsyncIterator[Any]:
        """The replies of a Generate the owner runs (its /web/stream): Deltas, then Generated or Err;
        `refused` alone when the owner cannot be asked."""
        hop = _hop(refused.address)
        try:
            async for reply in self._stream(request, refused, hop.headers):
                yield reply
        finally:
            hop.end()

    async def _stream(self, request: Any, refused: Any, trace_headers: dict[str, str]) -> AsyncIterator[Any]:
        body = {
            "session": request.session,
            "max_tokens": request.max_tokens,
            "ignore_eos": request.ignore_eos,
            "every_event": True,  # a Delta for each, as the socket sends them
        }
        events: list[EventMsg] = []
        url = f"{refused.address.rstrip('/')}/web/stream"
        timeout = httpx.Timeout(GENERATING_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        headers = {**self._session_headers(), **trace_headers}
        try:
            async with self._client.stream("POST", url, json=body, headers=headers, timeout=timeout) as answer:
                if answer.status_code != 200:
                    yield jsoncodec.loads(await answer.aread(), Reply)
                    return
                async for line in answer.aiter_lines():
                    frame = json.loads(line[len("data: ") :]) if line.startswith("data: {") else {}
                    if "committed" in frame:
                        events.append(jsoncodec.from_json(frame["committed"], EventMsg))
                        yield Reply.Delta(events[-1])
                    elif "done" in frame:
                        done = frame["done"]
                        yield Reply.Generated(events, done["tokens_generated"], done["finish"], done["warm_prefix"])
                        return
                    elif "error" in frame:
                        yield Reply.Err(frame["error"])
                        return
        except (httpx.HTTPError, ValueError, jsoncodec.JsonShapeError) as e:
            log.info("could not forward a Generate to %s: %s", refused.address, e)
            if not events:  # nothing happened there that the client saw
                yield refused
                return
        yield Reply.Err(f"the daemon serving session {request.session} ({refused.address}) ended its stream early")

    async def close(self) -> None:
        await self._client.aclose()
