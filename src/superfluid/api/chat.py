"""Stateless chat for the HTTP APIs: one request, one fresh session, one generation.

The OpenAI, Anthropic and Ollama routes translate their bodies into a `ChatRequest`. The
conversation is rendered through the chat template as a whole, committed as a new session
(`Created`, the conversation as one `Appended`, the assistant opener as
`GenerationPrompt`) and generated like any session, so it is logged, and its prefix is
cached for the next request of the same conversation. `ChatRun` turns the generation's
outcomes into pieces of reply: text, reasoning and tool calls, with stop strings applied
(and the log probabilities of the text's tokens, when the request's shaping asks for them).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ..core.constraints import ConstraintError, constraint_grammar
from ..core.daemon import Daemon
from ..core.errors import REFUSED, ContextTooLong
from ..core.generation import Committed, Done, Provisional
from ..core.runtime import Runtime
from ..engine.shaping import Shaping
from ..model.template import TemplateProblem
from ..protocol.schema import (
    CHANNEL_REASONING,
    FINISH_CANCELLED,
    FINISH_GRAMMAR,
    FINISH_LENGTH,
    FINISH_STOP,
    QOS_AGENT,
    ROLE_NAMES,
    EventBody,
    GenParams,
    Request,
)
from ..scheduler.prompt_pins import DEFAULT_TTL_MS
from ..telemetry import access_log
from .logprobs import LogprobText, TokenLogprob

B = EventBody


class ChatError(ValueError):
    """A chat request the daemon cannot serve; `status` is the HTTP status to answer with, `param`
    the request field at fault when one is."""

    def __init__(
        self, message: str, status: int = 400, code: str = "invalid_request_error", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.param = param


@dataclass
class ChatRequest:
    """A chat completion, whatever API it came through."""

    messages: list[dict[str, Any]]
    params: GenParams
    max_tokens: int | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"  # "auto", "none", "required" or {"function": {"name": ...}}
    parallel_tool_calls: bool = False  # a required call may be several (only when the request says so)
    stop: list[str] = field(default_factory=list)
    json_schema: Any = None  # a schema, or True for any JSON object
    qos: int = QOS_AGENT
    batch_invariant: bool = False
    prompt: str | None = None  # a raw prompt, rendered with no template at all
    ignore_eos: bool = False  # decode to max_tokens: end-of-generation tokens are never drawn
    shaping: Shaping | None = None  # logit bias, penalties, log probabilities
    template_vars: dict[str, Any] = field(default_factory=dict)  # for the chat template (enable_thinking, ...)
    # (session, event): continue that stored conversation after the event, warm; `messages` are then
    # only the new turns, with text content
    fork: tuple[int, int] | None = None
    # prompt-cache breakpoints: (message index, characters of its content) whose prefix is pinned
    cache_marks: list[tuple[int, int]] = field(default_factory=list)
    cache_ttl_ms: int = DEFAULT_TTL_MS
    prompt_tokens: list[int] | None = None  # a prompt given as token ids (a FIM prompt), rendered with no template


@dataclass(frozen=True)
class Piece:
    """Part of a reply: `kind` is "text", "reasoning" or "tool_call"."""

    kind: str
    text: str = ""
    name: str = ""
    arguments: str = ""
    call_id: str = ""
    logprobs: tuple[TokenLogprob, ...] = ()  # of the tokens of a text piece, when the request asked


@dataclass
class Outcome:
    """How a chat generation ended."""

    finish: str  # "stop", "length", "tool_calls" or "error"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    stopped_by: str | None = None  # the stop string that ended it
    error: str | None = None
    spec: tuple[int, int] = (0, 0)  # drafted tokens proposed and accepted (speculative decoding)


@dataclass
class Collected:
    """A whole reply: its text, its reasoning and the tool calls it made; `pieces` in order,
    neighbours of one kind joined."""

    text: str = ""
    reasoning: str = ""
    calls: list[Piece] = field(default_factory=list)
    pieces: list[Piece] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, piece: Piece) -> None:
        self.logprobs.extend(piece.logprobs)
        if piece.kind == "text":
            self.text += piece.text
        elif piece.kind == "reasoning":
            self.reasoning += piece.text
        else:
            self.calls.append(piece)
        last = self.pieces[-1] if self.pieces else None
        if last is not None and last.kind == piece.kind and piece.kind != "tool_call":
            self.pieces[-1] = Piece(piece.kind, last.text + piece.text)
        else:
            self.pieces.append(piece)


def rendered(request: ChatRequest, runtime: Runtime) -> tuple[list[int], list[int], list[int]]:
    """A request's prompt tokens, its assistant opener, and where its prompt-cache marks fall in the
    prompt; ChatError when the chat template cannot render it."""
    if request.prompt_tokens is not None:
        return list(request.prompt_tokens), [], []
    try:
        if request.prompt is not None:
            return runtime.model.tokenize(request.prompt, False), [], []
        tools = request.tools if request.tool_choice != "none" else []
        return runtime.template.marked_conversation(request.messages, tools, request.template_vars, request.cache_marks)
    except TemplateProblem as e:
        raise ChatError(str(e)) from None


def seed_for(seed: int | None) -> int:
    """A request's seed; none (or 0) draws a fresh one."""
    return seed if seed else secrets.randbits(63)


class ChatRun:
    """One chat generation on one model: iterate `pieces()`, then read `outcome`."""

    def __init__(self, daemon: Daemon, request: ChatRequest, runtime: Runtime) -> None:
        self.daemon = daemon
        self.runtime = runtime
        self.request = request
        self.outcome: Outcome | None = None
        n_vocab = runtime.model.n_vocab
        bad = [t for t, _ in request.shaping.logit_bias if not 0 <= t < n_vocab] if request.shaping else []
        if bad:
            raise ChatError(
                f"logit_bias names token {bad[0]}, outside this model's vocabulary (0..{n_vocab - 1})",
                param="logit_bias",
            )
        self._generation: Any = None
        self.marked = 0  # prompt tokens up to the last prompt-cache breakpoint
        self.grammar = self._grammar()
        if request.fork is None:
            self.session, self.prompt_tokens = self._open()
        else:
            self.session, self.prompt_tokens = self._fork(*request.fork)
        room = runtime.window - self.prompt_tokens
        limit = request.max_tokens or runtime.max_tokens
        self.max_tokens = min(limit, room) if limit else room

    @classmethod
    async def open(cls, daemon: Daemon, request: ChatRequest, runtime: Runtime) -> ChatRun:
        """A run whose session is committed (rendered and written on the daemon's writer thread, so the
        event loop never waits for the disk); ChatError when the request cannot be served."""
        return await daemon.written(cls, daemon, request, runtime)

    def _open(self) -> tuple[int, int]:
        """A fresh session holding the whole conversation: its id and its prompt length."""
        request, runtime = self.request, self.runtime
        prompt, opener, marks = rendered(request, runtime)
        try:
            session = self.daemon.open_chat(
                runtime, request.params, prompt, opener, request.qos, request.batch_invariant
            )
        except ContextTooLong as e:
            raise ChatError(str(e), code="context_length_exceeded") from None
        if runtime.pins is not None:
            for position in sorted(set(marks)):
                if runtime.pins.pin(prompt[:position], request.cache_ttl_ms):
                    self.marked = position
        return session, len(prompt) + len(opener)

    def _fork(self, parent: int, at_event: int) -> tuple[int, int]:
        """A fork of a stored conversation with the new turns appended: its id and its prompt length."""
        request = self.request
        roles = {name: role for role, name in ROLE_NAMES.items()}
        turns = [(roles[m["role"]], m["content"]) for m in request.messages]
        try:
            return self.daemon.fork_chat(
                self.runtime, parent, at_event, request.params, turns, request.qos, request.batch_invariant
            )
        except ContextTooLong as e:
            raise ChatError(str(e), code="context_length_exceeded") from None
        except REFUSED as e:
            raise ChatError(str(e)) from None

    def _grammar(self) -> str | None:
        """The grammar of the call `tool_choice` forces (one named tool, or any with "required"), else of
        the reply's JSON schema."""
        request = self.request
        choice = request.tool_choice
        forced: list[tuple[str, Any]] = []
        if request.tools and (choice == "required" or isinstance(choice, dict)):
            wanted = choice.get("function", choice).get("name") if isinstance(choice, dict) else None
            forced = [
                (t["function"]["name"], t["function"]["parameters"])
                for t in request.tools
                if wanted in (None, t["function"]["name"])
            ]
            if not forced:
                raise ChatError(f"tool_choice names {wanted!r}, which is not among the tools")
        try:
            return constraint_grammar(
                self.runtime.template,
                json_schema=None if forced else request.json_schema,
                tools=forced,
                parallel=request.parallel_tool_calls and not isinstance(choice, dict),
            )
        except ConstraintError as e:
            raise ChatError(str(e)) from None

    async def pieces(self) -> AsyncIterator[Piece]:
        try:
            generation = self._generation = await self.daemon.generate(
                Request.Generate(self.session, self.max_tokens, self.request.ignore_eos or None),
                provisional=True,
                grammar=self.grammar,
                runtime=self.runtime,
                shaping=self.request.shaping,
            )
        except REFUSED as e:
            self.outcome = Outcome("error", self.prompt_tokens, 0, 0, error=str(e))
            return
        stops = StopScanner(self.request.stop)
        logprobs = LogprobText(self.runtime.model.pieces)
        calls = 0
        ended = False
        try:
            async for outcome in generation:
                if isinstance(outcome, Provisional):
                    if outcome.channel == CHANNEL_REASONING:
                        yield Piece("reasoning", outcome.text)
                        continue
                    logprobs.add(outcome.logprobs)
                    text, hit = stops.feed(outcome.text)
                    rows = logprobs.release(len(text))
                    if text or rows:
                        yield Piece("text", text, logprobs=rows)
                    if hit is not None:
                        if (record := access_log.current()) is not None:
                            record.stop_string = True
                        generation.cancel()
                elif isinstance(outcome, Committed) and isinstance(outcome.event.body, B.ToolParseFailure):
                    # a call that does not read as one reaches the client as the text the model wrote
                    yield Piece("text", outcome.event.body.raw)
                elif isinstance(outcome, Committed) and isinstance(outcome.event.body, B.ToolUse):
                    calls += 1
                    body = outcome.event.body
                    yield Piece(
                        "tool_call", name=body.name, arguments=body.arguments, call_id=f"call_{outcome.event.event_id}"
                    )
                elif isinstance(outcome, Done):
                    ended = True
                    tail = stops.flush() if stops.hit is None else ""
                    rows = logprobs.release(len(tail)) + logprobs.rest(cut=stops.hit is not None)
                    if tail or rows:
                        yield Piece("text", tail, logprobs=rows)
                    self.outcome = Outcome(
                        _finish(outcome.finish, calls, stops.hit),
                        self.prompt_tokens,
                        outcome.tokens_generated,
                        outcome.warm_prefix,
                        stopped_by=stops.hit,
                        error=outcome.error,
                        spec=outcome.spec,
                    )
        finally:
            if not ended:
                generation.cancel()

    async def collect(self) -> Collected:
        """The whole reply, for a request that does not stream."""
        reply = Collected()
        async for piece in self.pieces():
            reply.add(piece)
        return reply

    @property
    def warm(self) -> int:
        """Prompt tokens served from the cache: known once the generation has a lane (0 before)."""
        return self._generation.warm_prefix if self._generation is not None else 0

    def result(self) -> Outcome | str:
        """How the run ended once its pieces are consumed: the outcome, or what went wrong."""
        if self.outcome is None:
            return "generation failed"
        return self.outcome.error or self.outcome

    def cancel(self) -> None:
        """Stop the generation (the client went away); harmless once it has ended."""
        if self._generation is not None:
            self._generation.cancel()


def _finish(code: int, calls: int, stopped_by: str | None) -> str:
    if stopped_by is not None:
        return "stop"
    if calls and code in (FINISH_STOP, FINISH_GRAMMAR):
        return "tool_calls"
    if code == FINISH_LENGTH:
        return "length"
    if code in (FINISH_STOP, FINISH_GRAMMAR, FINISH_CANCELLED):
        return "stop"
    return "error"


class StopScanner:
    """Cuts text at the first stop string, holding back a tail that may be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit: str | None = None

    def feed(self, text: str) -> tuple[str, str | None]:
        """Text safe to show now, and the stop string if one completed."""
        if self.hit is not None:
            return "", self.hit
        if not self.stops:
            return text, None
        self.held += text
        found = [(self.held.find(s), s) for s in self.stops if s in self.held]
        if found:
            at, stop = min(found)
            out, self.held, self.hit = self.held[:at], "", stop
            return out, stop
        keep = max((n for s in self.stops for n in range(1, len(s)) if self.held.endswith(s[:n])), default=0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep :]
        return out, None

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out
