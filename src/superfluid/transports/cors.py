"""Cross-origin requests to the HTTP API from the browser pages `--cors-origin` lists.

A page on another origin may call the API only when its origin is listed (or the list is `*`,
which `--api-key` and `--key-policy` refuse: a key in a page any site can load would be anyone's).
This wraps the whole listener, keys included, so that a preflight (which carries no key) is
answered here, and so that an error such as a 401 reaches the page readable. A listed origin is
reflected with `Vary: Origin` and may send credentials; an unlisted one gets no CORS header at
all, and the listener's own check refuses it (loopback pages excepted, as before).
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.datastructures import Headers, MutableHeaders
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ANY = "*"
METHODS = "GET, POST, DELETE, OPTIONS"
# what our replies carry that a page may want to read: the warm prefix, a session's owner, limits
EXPOSED = "x-superfluid-warm, x-superfluid-session-owner, retry-after, x-request-id"
MAX_AGE_S = 600


class CorsOrigins:
    """The origins a page may call from: exact `scheme://host[:port]` strings, or `*` for any."""

    def __init__(self, origins: Iterable[str]) -> None:
        listed = [origin.rstrip("/") for origin in origins]
        self.any = ANY in listed
        self.origins = frozenset(origin for origin in listed if origin != ANY)

    def __bool__(self) -> bool:
        return self.any or bool(self.origins)

    def allows(self, origin: str) -> bool:
        return self.any or origin in self.origins


def check_origin(text: str) -> str:
    """`--cors-origin`: `*`, or an origin as a browser sends it (a scheme and a host, no path)."""
    origin = text.rstrip("/")
    if origin == ANY:
        return origin
    scheme, sep, rest = origin.partition("://")
    if not sep or scheme not in ("http", "https") or not rest or "/" in rest:
        raise ValueError(
            f"expected an origin such as https://app.example.com or http://localhost:5173 (or *), not {text!r}"
        )
    return origin


class Cors:
    """ASGI middleware: answers preflights from listed origins and marks their replies readable."""

    def __init__(self, app: ASGIApp, origins: CorsOrigins) -> None:
        self.app = app
        self.origins = origins

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None or not self.origins.allows(origin):
            await self.app(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            preflight = PlainTextResponse("", 204, headers=self._allowed(origin))
            preflight.headers["access-control-allow-methods"] = METHODS
            asked = headers.get("access-control-request-headers")
            if asked:
                preflight.headers["access-control-allow-headers"] = asked
            preflight.headers["access-control-max-age"] = str(MAX_AGE_S)
            if headers.get("access-control-request-private-network") == "true":
                # Chromium asks before a public page may call a daemon on this machine or this network
                preflight.headers["access-control-allow-private-network"] = "true"
            await preflight(scope, receive, send)
            return

        async def marked(message: Message) -> None:
            if message["type"] == "http.response.start":
                reply = MutableHeaders(scope=message)
                for name, value in self._allowed(origin).items():
                    reply[name] = value
                reply["access-control-expose-headers"] = EXPOSED
            await send(message)

        await self.app(scope, receive, marked)

    def _allowed(self, origin: str) -> dict[str, str]:
        if self.origins.any and origin not in self.origins.origins:
            return {"access-control-allow-origin": ANY}
        return {"access-control-allow-origin": origin, "access-control-allow-credentials": "true", "vary": "Origin"}
