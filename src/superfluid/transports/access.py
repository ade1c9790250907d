"""Who may use the HTTP listener, how much, and in which scheduling class.

`--api-key` sets one key for every route but `/health` (and the browser UI's `/web/*`, which
take the web token instead); `--key-policy FILE.json` names
keys with their own scheduling class, ceiling, rate, concurrency and admin right;
`--rate-limit RPM` meters each client IP. `AccessGate` is the ASGI middleware that
applies all of it, and refuses new requests while the daemon drains (SIGUSR1).

A policy file:

    {"keys": [
      {"name": "chat-ui", "key_env": "CHAT_UI_KEY", "class": "interactive"},
      {"name": "agents", "key": "s3cret", "class": "background", "max_class": "agent",
       "rate_limit_rpm": 600, "max_concurrent": 8},
      {"name": "ops", "key_env": "OPS_KEY", "admin": true}
    ]}

Secrets are kept as SHA-256 digests and compared in constant time; logs and metrics name
keys, never their secrets.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..api import anthropic_errors
from ..protocol.schema import QOS_AGENT, qos_class
from .ratelimit import TokenBucket, retry_after_header

# the ASGI types as Starlette declares them
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

POLICY_FIELDS = {
    "name",
    "key",
    "key_env",
    "class",
    "max_class",
    "batch_invariant",
    "rate_limit_rpm",
    "max_concurrent",
    "admin",
}
NAME = re.compile(r"[A-Za-z0-9._-]+")
HEALTH_PATH = "/health"
OPEN_PATHS = {HEALTH_PATH}  # never keyed or metered; health says 503 while draining
WEB_PREFIX = "/web"  # the browser UI's routes on a loopback listener: the web token guards them
UNMETERED_PATHS = {"/health", "/metrics", "/v1/metrics"}  # keyed, but outside rate limits and slots
STATE_KEY = "superfluid_key"  # where the gate leaves a request's key, in the ASGI scope's state
REFUSED_KEY = "superfluid_refused_key"  # where it leaves the name of a valid key it refused (a rate, a limit)
GLOBAL_KEY = "api-key"  # the name `--api-key` has in metrics
PEERS_KEPT = 4096  # client IPs metered before the buckets that filled up again are dropped


ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error", 503: "server_error"}


@dataclass(frozen=True)
class Refusal:
    """An answer the gate gives instead of the route."""

    status: int
    body: dict[str, Any]
    headers: list[tuple[bytes, bytes]]
    key_name: str | None  # the key the request came with, when it was a valid one


class PolicyError(ValueError):
    """A key policy file superfluid refuses to start with."""


@dataclass
class Key:
    """One credential and what it may do."""

    name: str
    digest: bytes
    qos: int = QOS_AGENT
    max_qos: int = QOS_AGENT  # the most urgent class it may claim (0 interactive is the most urgent)
    batch_invariant: bool = False
    rate_limit_rpm: int = 0
    max_concurrent: int = 0
    admin: bool = False
    in_flight: int = 0
    bucket: TokenBucket | None = field(default=None, repr=False)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def load_policy(path: Path, api_key: str | None, environ: dict[str, str] | None = None) -> list[Key]:
    """The keys of a policy file, checked strictly: PolicyError says what is wrong and where."""
    environ = dict(os.environ) if environ is None else environ
    try:
        document = json.loads(path.read_text())
    except OSError as e:
        raise PolicyError(f"{path}: cannot read it: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise PolicyError(f"{path}: not JSON: {e}") from None
    if not isinstance(document, dict) or set(document) != {"keys"} or not isinstance(document["keys"], list):
        raise PolicyError(f'{path}: give {{"keys": [...]}} and nothing else')
    if not document["keys"]:
        raise PolicyError(f"{path}: the key list is empty; name at least one key")
    keys: list[Key] = []
    secrets_seen: set[bytes] = set()
    for index, entry in enumerate(document["keys"]):
        where = f"{path}: keys[{index}]"
        if not isinstance(entry, dict):
            raise PolicyError(f"{where}: each key is an object")
        unknown = sorted(set(entry) - POLICY_FIELDS)
        if unknown:
            raise PolicyError(
                f"{where}: unknown field {unknown[0]!r}; the fields are {', '.join(sorted(POLICY_FIELDS))}"
            )
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise PolicyError(f"{where}: name must be letters, digits, '.', '_' or '-'")
        if any(k.name == name for k in keys):
            raise PolicyError(f"{where}: the name {name!r} is used twice")
        secret = _secret(entry, environ, where)
        if secret == name:
            raise PolicyError(f"{where}: the key must not equal its name")
        if api_key is not None and secret == api_key:
            raise PolicyError(f"{where}: the key is the same as --api-key")
        if digest(secret) in secrets_seen:
            raise PolicyError(f"{where}: the same key as an earlier entry")
        secrets_seen.add(digest(secret))
        qos = _class(entry.get("class", "agent"), where, "class")
        max_qos = _class(entry.get("max_class", entry.get("class", "agent")), where, "max_class")
        if max_qos > qos:
            raise PolicyError(f"{where}: max_class must be as urgent as class or more")
        key = Key(
            name,
            digest(secret),
            qos,
            max_qos,
            _flag(entry, "batch_invariant", where),
            _count(entry, "rate_limit_rpm", where),
            _count(entry, "max_concurrent", where),
            _flag(entry, "admin", where),
        )
        if key.rate_limit_rpm:
            key.bucket = per_minute(key.rate_limit_rpm)
        keys.append(key)
    return keys


def _secret(entry: dict[str, Any], environ: dict[str, str], where: str) -> str:
    if ("key" in entry) == ("key_env" in entry):
        raise PolicyError(f"{where}: give exactly one of key and key_env")
    if "key" in entry:
        secret = entry["key"]
    else:
        secret = environ.get(str(entry["key_env"]))
        if secret is None:
            raise PolicyError(f"{where}: key_env names ${entry['key_env']}, which is not set")
    if not isinstance(secret, str) or not secret:
        raise PolicyError(f"{where}: the key must be a non-empty string")
    return secret


def _class(value: Any, where: str, name: str) -> int:
    try:
        return qos_class(str(value))
    except ValueError as e:
        raise PolicyError(f"{where}: {name}: {e}") from None


def _flag(entry: dict[str, Any], name: str, where: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise PolicyError(f"{where}: {name} must be true or false")
    return value


def _count(entry: dict[str, Any], name: str, where: str) -> int:
    value = entry.get(name, 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PolicyError(f"{where}: {name} must be a whole number, 0 for no limit")
    return value


def per_minute(rpm: int) -> TokenBucket:
    """A bucket that allows `rpm` requests a minute, all of them at once after a quiet minute."""
    return TokenBucket(rate=rpm / 60.0, burst=rpm)


def is_admin_route(method: str, path: str) -> bool:
    """Routes that change what is loaded: model load, unload and forget."""
    return (method == "POST" and path in ("/v1/models/load", "/v1/models/unload")) or (
        method == "DELETE" and path.startswith("/v1/models/")
    )


class AccessGate:
    """ASGI middleware: keys, admin rights, rate limits, concurrency slots and draining.

    The key a request came with is left in `scope["state"]["superfluid_key"]` (None when
    keys are off or for the global key), where the routes read its scheduling class.
    """

    def __init__(self, app: App, api_key: str | None, keys: list[Key], rate_limit_rpm: int) -> None:
        self.app = app
        self.global_digest = digest(api_key) if api_key else None
        self.keys = keys
        self.keyed = bool(keys) or api_key is not None
        self.rate_limit_rpm = rate_limit_rpm
        self._peers: dict[str, TokenBucket] = {}
        self.draining = False
        self.drain_retry_s = 60.0
        self.in_flight = 0
        self.counts: dict[tuple[str, str], int] = {}  # (key name, outcome) -> requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope["path"]
        if scope["type"] == "http" and path == HEALTH_PATH and self.draining:
            # a load balancer's health check takes a draining daemon out of rotation
            payload = b'{"status":"draining"}'
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": 503, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        if scope["type"] != "http" or path in OPEN_PATHS or path == WEB_PREFIX or path.startswith(WEB_PREFIX + "/"):
            await self.app(scope, receive, send)
            return
        refusal, key = self._admit(scope)
        if refusal is not None:
            scope.setdefault("state", {})[REFUSED_KEY] = refusal.key_name
            body = refusal.body
            if anthropic_errors.is_anthropic(scope["path"]):  # Anthropic's clients read their own error shape
                body = anthropic_errors.body(body["error"]["message"], refusal.status)
            payload = json.dumps(body).encode()
            headers = [*refusal.headers, (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": refusal.status, "headers": headers})
            await send({"type": "http.response.body", "body": payload})
            return
        metered = scope["path"] not in UNMETERED_PATHS
        scope.setdefault("state", {})[STATE_KEY] = key
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if key is not None and metered:
                key.in_flight -= 1

    def _admit(self, scope: Scope) -> tuple[Refusal | None, Key | None]:
        """(None, the key) for a request that may go on; (its refusal, None) otherwise."""
        if self.draining:
            message = "superfluid is draining and takes no new requests; retry once it is back"
            return self._refuse("-", "draining", 503, "draining", message, self.drain_retry_s)
        key: Key | None = None
        name = "-"
        if self.keyed:
            presented = _presented_key(scope)
            if presented is None:
                message = "no API key: send Authorization: Bearer <key> or X-Api-Key: <key>"
                return self._refuse(name, "missing", 401, "invalid_api_key", message)
            found = self._find(digest(presented))
            if found is None:
                return self._refuse(name, "invalid", 401, "invalid_api_key", "the API key is not valid")
            key = found if isinstance(found, Key) else None
            name = key.name if key is not None else GLOBAL_KEY
            if is_admin_route(scope["method"], scope["path"]) and key is not None and not key.admin:
                # (Ollama's keep_alive unloads too: its route asks `may_administer`)
                message = f"loading and unloading models needs an admin key; key {key.name!r} is not one"
                return self._refuse(name, "admin_required", 403, "admin_required", message)
        if scope["path"] in UNMETERED_PATHS:
            return None, key
        if key is not None and key.bucket is not None:
            wait = key.bucket.take()
            if wait:
                message = f"key {key.name!r} is over its {key.rate_limit_rpm} requests a minute"
                return self._refuse(name, "rate_limited", 429, "rate_limit_exceeded", message, wait)
        elif self.rate_limit_rpm:
            peer = (scope.get("client") or ("?", 0))[0]
            if peer not in self._peers and len(self._peers) >= PEERS_KEPT:
                self._peers = {ip: bucket for ip, bucket in self._peers.items() if not bucket.rested()}
            wait = self._peers.setdefault(peer, per_minute(self.rate_limit_rpm)).take()
            if wait:
                message = f"{peer} is over the {self.rate_limit_rpm} requests a minute this server allows a client"
                return self._refuse(name, "rate_limited", 429, "rate_limit_exceeded", message, wait)
        if key is not None:
            if key.max_concurrent and key.in_flight >= key.max_concurrent:
                message = f"key {key.name!r} already has {key.max_concurrent} requests running, its limit"
                return self._refuse(name, "concurrency", 429, "concurrency_limit_exceeded", message, 1.0)
            key.in_flight += 1
        self.counts[name, "admitted"] = self.counts.get((name, "admitted"), 0) + 1
        return None, key

    def _refuse(
        self, name: str, reason: str, status: int, code: str, message: str, retry_after_s: float | None = None
    ) -> tuple[Refusal, None]:
        """A refusal in the OpenAI error envelope, counted by key and reason."""
        self.counts[name, reason] = self.counts.get((name, reason), 0) + 1
        headers = [(b"content-type", b"application/json")]
        if retry_after_s is not None:
            headers.append((b"retry-after", retry_after_header(retry_after_s).encode()))
        body = {"error": {"message": message, "type": ERROR_TYPES[status], "param": None, "code": code}}
        return Refusal(status, body, headers, None if name == "-" else name), None

    def _find(self, presented: bytes) -> Key | bool | None:
        """The policy key with this digest, True for the global key, None for neither; every
        digest is compared, so the time taken says nothing about which one matched."""
        found: Key | bool | None = None
        if self.global_digest is not None and hmac.compare_digest(presented, self.global_digest):
            found = True
        for key in self.keys:
            if hmac.compare_digest(presented, key.digest):
                found = key
        return found


def request_key(scope: Scope) -> Key | None:
    """The policy key a request came with; None without keys, or with the global `--api-key`."""
    return scope.get("state", {}).get(STATE_KEY)


def may_administer(scope: Scope) -> bool:
    """Whether a request may load and unload models: keys off, the global key, or an admin key."""
    key = request_key(scope)
    return key is None or key.admin


def _presented_key(scope: Scope) -> str | None:
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
    authorization = headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    api_key = headers.get("x-api-key", "").strip()
    return api_key or None
