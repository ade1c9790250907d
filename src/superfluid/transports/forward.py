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
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

log = logging.getLogger("superfluid.forward")

FORWARDED_HEADER = "x-superfluid-forwarded"
# hop-by-hop headers, and those the new hop sets itself
DROPPED = frozenset(
    {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade", "trailer"}
)
CONNECT_TIMEOUT_S = 5.0


def forwarded(request: Request) -> bool:
    """Whether this request came from another daemon (it is not sent on again)."""
    return FORWARDED_HEADER in request.headers


def _headers(headers: Mapping[str, str], **extra: str) -> dict[str, str]:
    kept = {name: value for name, value in headers.items() if name.lower() not in DROPPED}
    return {**kept, **extra}


class Forwarder:
    """Sends requests on to the daemons that own their sessions, over one pool of connections."""

    def __init__(self, daemon_id: str) -> None:
        self.daemon_id = daemon_id
        # no read timeout: a generation's stream may pause as long as the owner's does
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))

    @staticmethod
    def reaches(owner: str) -> bool:
        """Whether an owner's address is one a request can be sent to (a unix socket's is not)."""
        return owner.startswith(("http://", "https://"))

    async def send(self, request: Request, body: bytes, owner: str) -> Response:
        """The owner's answer to `request` (whose `body` was read already); 502 when the owner is out of reach."""
        url = owner.rstrip("/") + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        outgoing = self._client.build_request(
            request.method,
            url,
            content=body,
            headers=_headers(request.headers, **{FORWARDED_HEADER: self.daemon_id}),
        )
        try:
            upstream = await self._client.send(outgoing, stream=True)
        except httpx.HTTPError as e:
            log.warning("forwarding %s %s to %s failed: %s", request.method, request.url.path, owner, e)
            return Response(
                f'{{"error":"the daemon serving this session ({owner}) is out of reach: {type(e).__name__}"}}',
                502,
                media_type="application/json",
            )
        log.debug("forwarded %s %s to %s: %d", request.method, request.url.path, owner, upstream.status_code)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when our client hangs up: the owner sees its client go
                await upstream.aclose()

        return StreamingResponse(relay(), upstream.status_code, headers=_headers(upstream.headers))

    async def close(self) -> None:
        await self._client.aclose()
