"""A client of superfluid's session API over /web/rpc and /web/stream, standard library only.

Every call is one HTTP request on a fresh connection; a generation is a server-sent
event stream. The random draw for each token depends only on the session's seed and the
token's position, so forks that share a seed share their draws, and a generation cut by
a cancel continues exactly where it stopped.
"""

from __future__ import annotations

import http.client
import json
import os
import secrets
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8460"

SYSTEM, USER, ASSISTANT, TOOL = 0, 1, 2, 3
TEXT, REASONING, TOOL_CALL = 0, 1, 2

FINISH = {0: "none", 1: "stop", 2: "length", 3: "grammar", 4: "cancelled", 5: "error"}
ROLES = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}
ROLE_NAMES = {SYSTEM: "system", USER: "user", ASSISTANT: "assistant"}
CHUNK_KINDS = {TEXT: "text", REASONING: "reasoning", TOOL_CALL: "tool_call"}
BUSY_MARK = " is generating;"


class SuperfluidError(Exception):
    """A refusal from the daemon, or a transport failure; `status` is the HTTP status if any."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class SessionBusy(SuperfluidError):
    """The session is generating; append or generate after it finishes, or cancel it."""


def _refusal(message: str) -> SuperfluidError:
    """An in-band refusal (Err on 200, or an SSE error frame)."""
    return SessionBusy(message) if BUSY_MARK in message else SuperfluidError(message)


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters: each token's draw depends only on the seed and its position."""

    temperature: float = 0.7
    top_p: float = 0.95
    min_p: float = 0.0
    top_k: int = 20
    seed: int = field(default_factory=lambda: secrets.randbits(63))

    @classmethod
    def greedy(cls) -> Sampling:
        return cls(temperature=0.0, top_p=1.0, min_p=0.0, top_k=0, seed=0)

    def with_seed(self, seed: int) -> Sampling:
        return replace(self, seed=seed)

    def to_wire(self) -> dict[str, Any]:
        return {
            "temperature": float(self.temperature),
            "top_p": float(self.top_p),
            "min_p": float(self.min_p),
            "top_k": int(self.top_k),
            "seed": int(self.seed),
        }

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Sampling:
        return cls(obj["temperature"], obj["top_p"], obj["min_p"], obj["top_k"], obj["seed"])


@dataclass(frozen=True)
class Event:
    """One committed event of a session's log."""

    id: int
    kind: str
    data: dict[str, Any]
    ts_ms: int
    epoch: int

    @classmethod
    def from_wire(cls, obj: dict[str, Any]) -> Event:
        body = obj["body"]
        if isinstance(body, str):
            kind, data = body, {}
        else:
            ((kind, value),) = body.items()
            data = value if isinstance(value, dict) else {"value": value}
        return cls(obj["event_id"], kind, data, obj["ts_unix_ms"], obj["epoch"])

    @property
    def text(self) -> str | None:
        return self.data.get("text")

    @property
    def channel(self) -> int | None:
        return self.data.get("channel")


@dataclass(frozen=True)
class ToolCall:
    """A call the model made; `id` is its ToolUse event id, `arguments` JSON text."""

    id: int
    name: str
    arguments: str

    def json(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Chunk:
    """A piece of a streaming reply; `kind` is "text", "reasoning" or "tool_call"."""

    kind: str
    text: str


@dataclass
class Reply:
    """A finished generation, from its committed events."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finish: str = "none"
    tokens: int = 0
    warm_prefix: int = 0
    events: list[Event] = field(default_factory=list)

    def __str__(self) -> str:
        return self.text


def drop_events(start: int, end: int) -> dict[str, Any]:
    """A Rebase edit dropping events [start, end)."""
    return {"Drop": {"from": start, "to": end}}


def replace_events(start: int, end: int, role: int | str, text: str) -> dict[str, Any]:
    """A Rebase edit replacing events [start, end) with one message."""
    return {"Replace": {"from": start, "to": end, "role": ROLES.get(role, role), "text": text}}  # type: ignore[arg-type]


def _token_path() -> Path:
    home = os.environ.get("SUPERFLUID_HOME") or str(Path.home() / ".superfluid")
    return Path(home).expanduser() / "sessions" / "web-token"


OWNER_HEADER = "X-Superfluid-Session-Owner"
MAX_FOLLOWS = 3  # a session moving again while it is followed; more is a loop


class Client:
    """The session API at `url`: http://127.0.0.1:8460, or $SUPERFLUID_WEB_URL."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        token_file: str | os.PathLike[str] | None = None,
        timeout: float = 600.0,
    ) -> None:
        self._point_at(url or os.environ.get("SUPERFLUID_WEB_URL") or DEFAULT_URL)
        self.timeout = timeout
        self._token = self._resolve_token(token, token_file)

    def _point_at(self, url: str) -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"superfluid's web transport is plain http; got {url!r}")
        self.url, self._host, self._port = url, parsed.hostname, parsed.port or 80

    @staticmethod
    def _resolve_token(token: str | None, token_file: str | os.PathLike[str] | None) -> str:
        if token is not None:
            return token
        if token_file is not None:
            return Path(token_file).read_text().strip()
        from_env = os.environ.get("SUPERFLUID_WEB_TOKEN", "").strip()
        if from_env:
            return from_env
        path = _token_path()
        try:
            return path.read_text().strip()
        except FileNotFoundError:
            raise SuperfluidError(
                f"no web token at {path}; start the server with --web 127.0.0.1:PORT, or pass token="
            ) from None

    # ---- transport ----

    def _connection(self, timeout: float | None = None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout or self.timeout)

    def _headers(self) -> dict[str, str]:
        return {
            "authorization": f"Bearer {self._token}",
            "x-superfluid-csrf": self._token,
            "content-type": "application/json",
        }

    def _post(self, path: str, body: Any) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST `body`; a session another daemon of the same store serves (409 naming its address)
        is followed there, and this client talks to that daemon from then on."""
        for hop in range(MAX_FOLLOWS + 1):
            connection = self._connection()
            try:
                connection.request("POST", path, body=json.dumps(body).encode("ascii"), headers=self._headers())
                response = connection.getresponse()
            except BaseException:
                connection.close()
                raise
            owner = response.getheader(OWNER_HEADER) if response.status == 409 else None
            moved = owner is not None and owner.startswith("http://") and owner.rstrip("/") != self.url.rstrip("/")
            if hop == MAX_FOLLOWS or not moved:
                break  # a daemon with no web address names its socket: nothing to follow
            response.read()
            connection.close()
            self._point_at(owner)
        if response.status != 200:
            raw = response.read()
            connection.close()
            raise SuperfluidError(f"{path}: {response.status} {_message_of(raw, response.reason)}", response.status)
        return connection, response

    def call(self, verb: str, args: Any = None) -> tuple[str, Any]:
        """Send one raw request; returns (variant, payload). An `Err` raises."""
        connection, response = self._post("/web/rpc", {verb: args})
        try:
            reply = json.loads(response.read())
        finally:
            connection.close()
        if isinstance(reply, str):
            variant, payload = reply, None
        elif isinstance(reply, dict) and len(reply) == 1:
            ((variant, payload),) = reply.items()
        else:
            raise SuperfluidError(f"{verb}: unexpected response {reply!r}")
        if variant == "Err":
            raise _refusal((payload or {}).get("message", ""))
        return variant, payload

    def _expect(self, verb: str, args: Any, wanted: str) -> Any:
        variant, payload = self.call(verb, args)
        if variant != wanted:
            raise SuperfluidError(f"{verb}: expected {wanted}, got {variant}")
        return payload

    # ---- calls ----

    def session(
        self,
        sampling: Sampling | None = None,
        *,
        system: str | None = None,
        tools: Iterable[dict[str, Any] | str] | None = None,
    ) -> Session:
        """A new session, opened with the system message and tools given."""
        sampling = sampling or Sampling()
        created = self._expect("Create", {"parent": None, "params": sampling.to_wire()}, "Created")
        session = Session(self, created["session"], sampling)
        tools = list(tools or [])
        if tools:
            session.declare(system=system, tools=tools)
        elif system is not None:
            session.system(system)
        return session

    def get(self, session_id: int) -> Session:
        """An existing session by id (after a restart too)."""
        inspection = self.inspect(session_id)
        return Session(self, session_id, Sampling.from_wire(inspection["params"]))

    def inspect(self, session_id: int) -> dict[str, Any]:
        return self._expect("Inspect", {"session": session_id}, "Inspection")["inspection"]

    def sessions(self, include_archived: bool = False) -> list[dict[str, Any]]:
        return self._expect("Sessions", {"include_archived": include_archived}, "SessionList")["sessions"]

    def tree(self) -> list[tuple[int, int | None, int]]:
        return [tuple(node) for node in self._expect("Tree", None, "Tree")["nodes"]]  # type: ignore[misc]

    def complete(self, prefix: str, suffix: str = "", max_tokens: int = 64, mode: int = 0) -> dict[str, Any]:
        """Fill in the middle between `prefix` and `suffix`."""
        args = {"prefix": prefix, "suffix": suffix, "mode": mode, "max_tokens": max_tokens}
        return self._expect("Complete", args, "Completion")

    def metrics(self) -> str:
        return self._expect("Metrics", None, "Text")["text"]

    def set_background_rate(self, divisor: int) -> None:
        self._expect("SetBackgroundRate", {"divisor": divisor}, "Ack")

    def health(self) -> bool:
        connection = self._connection(timeout=5.0)
        try:
            connection.request("GET", "/web/health")
            return connection.getresponse().status == 200
        except OSError:
            return False
        finally:
            connection.close()


def _message_of(raw: bytes, reason: str) -> str:
    try:
        body = json.loads(raw)
        return body["Err"]["message"]
    except (ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", "replace").strip()
        return text or reason


class Session:
    """One session of the daemon, by id."""

    def __init__(self, client: Client, session_id: int, sampling: Sampling) -> None:
        self.client = client
        self.id = session_id
        self.sampling = sampling
        self._cursor = 0

    def __repr__(self) -> str:
        return f"Session({self.id})"

    def _seen(self, event: Event) -> Event:
        self._cursor = max(self._cursor, event.id + 1)
        return event

    def _commit(self, verb: str, args: dict[str, Any]) -> Event:
        payload = self.client._expect(verb, {"session": self.id, **args}, "Committed")
        return self._seen(Event.from_wire(payload["event"]))

    # ---- appending ----

    def say(self, role: int | str, text: str) -> Event:
        return self._commit("AppendMessage", {"role": ROLES.get(role, role), "text": text})  # type: ignore[arg-type]

    def system(self, text: str) -> Event:
        return self.say(SYSTEM, text)

    def user(self, text: str) -> Event:
        return self.say(USER, text)

    def assistant(self, text: str) -> Event:
        return self.say(ASSISTANT, text)

    def declare(self, *, system: str | None = None, tools: Iterable[dict[str, Any] | str] = ()) -> Event:
        """Open the session with a system turn declaring tools (dicts or JSON strings)."""
        wire = [t if isinstance(t, str) else json.dumps(t) for t in tools]
        return self._commit("AppendSystem", {"text": system, "tools": wire})

    def append_tokens(self, tokens: list[int], text: str | None = None) -> Event:
        return self._commit("Append", {"text": text, "span": list(tokens)})

    def tool_result(self, call: ToolCall | int, content: str) -> Event:
        call_id = call.id if isinstance(call, ToolCall) else call
        return self._commit("AppendToolResult", {"call_id": call_id, "content": content})

    def image(self, blob: str, *, before: str = "", after: str = "", role: int | str = "user") -> Event:
        args = {"role": ROLES.get(role, role), "blob": blob, "pre_text": before, "post_text": after}  # type: ignore[arg-type]
        return self._commit("AppendImage", args)

    # ---- generating ----

    def stream(
        self,
        max_tokens: int = 1024,
        *,
        provisional: bool = True,
        ignore_eos: bool = False,
        grammar: str | None = None,
    ) -> Stream:
        """The next turn, chunk by chunk; leaving the loop early cancels the generation.

        `ignore_eos` decodes to `max_tokens`; `grammar` (GBNF with a `root` rule) constrains
        every token, and the turn ends (finish "grammar") when it is complete.
        """
        extra: dict[str, Any] = {}
        if ignore_eos:
            extra["ignore_eos"] = True
        if grammar is not None:
            extra["grammar"] = grammar
        return Stream(self, max_tokens, provisional, extra)

    def generate(
        self,
        max_tokens: int = 1024,
        *,
        on_text: Callable[[Chunk], None] | None = None,
        ignore_eos: bool = False,
        grammar: str | None = None,
    ) -> Reply:
        stream = self.stream(max_tokens, provisional=on_text is not None, ignore_eos=ignore_eos, grammar=grammar)
        for chunk in stream:
            if on_text is not None:
                on_text(chunk)
        assert stream.reply is not None
        return stream.reply

    def cancel(self) -> bool:
        """Stop the generation in flight; False when there was none."""
        try:
            self.client._expect("Cancel", {"session": self.id}, "Cancelling")
        except SuperfluidError as e:
            if "no generation in flight" in e.message:
                return False
            raise
        return True

    # ---- branching ----

    @property
    def head(self) -> int:
        """The next event id: everything committed so far."""
        for event in self.events(self._cursor):
            self._seen(event)
        return self._cursor

    def fork(self, at: int | None = None, *, seed: int | None = None, sampling: Sampling | None = None) -> Session:
        """A new session holding the events before `at` (default: all of them)."""
        at = self.head if at is None else at
        if sampling is None and seed is not None:
            sampling = self.sampling.with_seed(seed)
        args = {"session": self.id, "at_event": at, "params": sampling.to_wire() if sampling else None}
        child = self.client._expect("Fork", args, "Created")["session"]
        return Session(self.client, child, sampling or self.sampling)

    def fork_after(self, event_or_id: Event | int, **kw: Any) -> Session:
        event_id = event_or_id.id if isinstance(event_or_id, Event) else event_or_id
        return self.fork(event_id + 1, **kw)

    def rebase(self, edits: list[dict[str, Any]], *, sampling: Sampling | None = None) -> Session:
        args = {"session": self.id, "edits": edits, "params": sampling.to_wire() if sampling else None}
        child = self.client._expect("Rebase", args, "Created")["session"]
        return Session(self.client, child, sampling or self.sampling)

    def edit(self, event_or_id: Event | int, text: str, *, role: int | str | None = None) -> Session:
        """A new branch: the history before this message, then the message with new text."""
        event = self.event(event_or_id) if isinstance(event_or_id, int) else event_or_id
        if event.kind != "Message":
            raise ValueError(f"event {event.id} is a {event.kind}, not a Message")
        chosen = event.data["role"] if role is None else role
        return self.rebase([replace_events(event.id, self.head, chosen, text)])

    def trim(self, to_event: int) -> Session:
        child = self.client._expect("Trim", {"session": self.id, "to_event": to_event}, "Created")["session"]
        return Session(self.client, child, self.sampling)

    # ---- reading ----

    def events(self, cursor: int = 0) -> list[Event]:
        payload = self.client._expect("Read", {"session": self.id, "cursor": cursor}, "Events")
        return [Event.from_wire(e) for e in payload["events"]]

    def event(self, event_id: int) -> Event:
        for event in self.events(event_id):
            if event.id == event_id:
                return event
        raise SuperfluidError(f"session {self.id} has no event {event_id}")

    def messages(self) -> list[dict[str, Any]]:
        return fold_messages(self.events(0))

    def inspect(self) -> dict[str, Any]:
        return self.client.inspect(self.id)

    def open_tool_calls(self) -> list[ToolCall]:
        calls = self.client._expect("OpenToolCalls", {"session": self.id}, "ToolCalls")["calls"]
        return [ToolCall(call_id, name, arguments) for call_id, name, arguments in calls]

    # ---- scheduling and metadata ----

    def pin(self, ttl_s: float) -> int:
        """Keep the session's prefix cached for `ttl_s` seconds (0 clears); returns the deadline."""
        args = {"session": self.id, "ttl_ms": int(ttl_s * 1000)}
        return self.client._expect("Pin", args, "Pinned")["deadline_unix_ms"]

    def set_qos(self, qos_class: int, *, batch_invariant: bool = False) -> Event:
        return self._commit("SetQos", {"class": qos_class, "batch_invariant": batch_invariant})

    def set_meta(self, *, title: str | None = None, archived: bool | None = None) -> int:
        version = self.inspect()["summary"]["meta_version"]
        args = {"session": self.id, "expected_version": version, "title": title, "archived": archived}
        return self.client._expect("SetMeta", args, "Meta")["version"]

    def purge(self, *, cascade: bool = True) -> list[int]:
        generation = self.inspect()["summary"]["generation"]
        args = {"session": self.id, "expected_generation": generation, "mode": "Cascade" if cascade else "Reroot"}
        return self.client._expect("Purge", args, "Purged")["sessions"]


class Stream:
    """A generation as it happens: iterate for `Chunk`s; `reply` is set when it ends.

    Nothing is sent until iteration starts. Leaving the loop early (or dropping the
    stream) cancels the generation on a second connection and waits for its summary.
    """

    def __init__(
        self, session: Session, max_tokens: int, provisional: bool, extra: dict[str, Any] | None = None
    ) -> None:
        self.session = session
        self._outcome = _Outcome()
        # the generator holds the outcome, not the stream: dropping the stream closes it
        self._chunks = _stream(session, max_tokens, provisional, self._outcome, extra or {})

    @property
    def reply(self) -> Reply | None:
        return self._outcome.reply

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()


class _Outcome:
    reply: Reply | None = None


def _frames(response: http.client.HTTPResponse) -> Iterator[dict[str, Any]]:
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].lstrip(" ")
        if data == "[DONE]":
            return
        yield json.loads(data)


def _stream(
    session: Session, max_tokens: int, provisional: bool, outcome: _Outcome, extra: dict[str, Any]
) -> Iterator[Chunk]:
    body = {"session": session.id, "max_tokens": max_tokens, "provisional": provisional, **extra}
    connection, response = session.client._post("/web/stream", body)
    frames = _frames(response)
    committed: list[Event] = []
    done: dict[str, Any] | None = None
    started = False
    try:
        for frame in frames:
            if "error" in frame:
                raise _refusal(frame["error"])
            started = True
            if "provisional" in frame:
                piece = frame["provisional"]
                if piece.get("text"):
                    yield Chunk(CHUNK_KINDS.get(piece.get("channel"), "text"), piece["text"])
            elif "committed" in frame:
                event = session._seen(Event.from_wire(frame["committed"]))
                committed.append(event)
                if not provisional and event.kind == "Generated" and event.text:
                    yield Chunk(CHUNK_KINDS.get(event.channel, "text"), event.text)  # type: ignore[arg-type]
            elif "done" in frame:
                done = frame["done"]
    finally:
        if started and done is None:
            done = _stop(session, frames, committed)
        connection.close()
    if done is None:
        raise SuperfluidError("the stream ended without a summary")
    outcome.reply = _reply(committed, done)


def _stop(session: Session, frames: Iterator[dict[str, Any]], committed: list[Event]) -> dict[str, Any] | None:
    """Cancel on a second connection, then read the stream to its summary."""
    try:
        session.cancel()
        for frame in frames:
            if "committed" in frame:
                committed.append(session._seen(Event.from_wire(frame["committed"])))
            if "done" in frame:
                return frame["done"]
            if "error" in frame:
                return None
    except (SuperfluidError, OSError, ValueError):
        pass
    return None


def _reply(events: list[Event], done: dict[str, Any]) -> Reply:
    reply = Reply(
        finish=FINISH.get(done["finish"], str(done["finish"])),
        tokens=done["tokens_generated"],
        warm_prefix=done["warm_prefix"],
        events=events,
    )
    for event in events:
        if event.kind == "Generated":
            if event.channel == REASONING:
                reply.reasoning += event.text or ""
            else:
                reply.text += event.text or ""
        elif event.kind == "ToolUse":
            reply.tool_calls.append(ToolCall(event.id, event.data["name"], event.data["arguments"]))
    return reply


def fold_messages(events: list[Event]) -> list[dict[str, Any]]:
    """Events as chat messages: each assistant turn is its Generated events up to a finish."""
    messages: list[dict[str, Any]] = []
    for event in events:
        if event.kind == "Message":
            messages.append(
                {"role": ROLE_NAMES.get(event.data["role"], "tool"), "content": event.data["text"], "event": event.id}
            )
        elif event.kind == "Generated":
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or last.get("_closed"):
                last = {"role": "assistant", "content": ""}
                messages.append(last)
            if event.channel == REASONING:
                last["reasoning"] = last.get("reasoning", "") + (event.text or "")
            else:
                last["content"] += event.text or ""
            if event.data.get("finish"):
                last["_closed"] = True
        elif event.kind == "ToolUse":
            messages.append(
                {
                    "role": "tool_call",
                    "name": event.data["name"],
                    "arguments": event.data["arguments"],
                    "event": event.id,
                }
            )
        elif event.kind == "ToolResult":
            messages.append(
                {"role": "tool", "call_id": event.data["call_id"], "content": event.data["content"], "event": event.id}
            )
    for message in messages:
        message.pop("_closed", None)
    return messages
