"""The session API, independent of any transport: a `Request` in, `Response`s out.

Every verb checks its input against the session state, builds the records it commits
(with the exact token spans they put on the model's input), commits them through the
store and answers from what was committed. Refusals raise `DaemonError`, whose text
is the `Err` message the client sees; nothing is written when a request is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import sqlite3
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from ..engine.grammar import Grammar, GrammarError, schema_grammar, tool_call_grammar
from ..engine.llama import LlamaModel
from ..engine.shaping import Shaping
from ..logsetup import set_log_directive
from ..metrics import Metrics
from ..model.blocks import BlockError, project_block
from ..model.channels import ChannelSplitter
from ..model.template import ChatTemplate, TemplateProblem
from ..model.tools import ToolDeclarationError, fallback_system_text, normalize_tool, normalize_tools
from ..protocol.schema import (
    BLOCK_IMAGE,
    CHANNEL_TEXT,
    FINISH_GRAMMAR,
    FINISH_STOP,
    LEDGER_CANCEL_REQUESTED,
    LEDGER_OPEN,
    LEDGER_SUCCEEDED,
    MODEL_VISIBILITY_VERSION,
    OUTCOME_CANCELLED,
    OUTCOME_FAILED,
    QOS_AGENT,
    QOS_COMPLETION,
    QOS_NAMES,
    ROLE_ASSISTANT,
    ROLE_SYSTEM,
    ROLE_TOOL,
    TOKEN_BEARING,
    EventBody,
    EventMsg,
    GenParams,
    Inspection,
    PurgeMode,
    RebaseEdit,
    Request,
    Response,
    SessionSummary,
    Tier,
)
from ..scheduler.scheduler import Job, Scheduler
from ..store.errors import StoreError
from ..store.leases import LeaseLost, SessionElsewhere
from ..store.media import MediaStore
from ..store.sessions import SessionStore, now_ms
from ..store.state import SessionState, ToolCallState
from .bus import END_PURGED, Bus, Subscription
from .cluster import RemoteCommits
from .fim import FimError, check_fim, fim_prompt, fim_runtime
from .generation import Done, GenerationRun, Generations, Outcome
from .runtime import Models, Runtime

log = logging.getLogger("superfluid.core.daemon")
B = EventBody
R = Request

PURGE_WAIT_S = 10.0
COMPLETION_CACHE = 256
GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
# A generation that ended its turn with an end-of-turn token: after the end of the grammar
# too, since a complete grammar allows nothing but end-of-generation.
TURN_ENDED = (FINISH_STOP, FINISH_GRAMMAR)
# Records a Generate streams to its caller as they commit.
STREAMED = (B.Generated, B.ToolUse, B.ToolResult, B.ToolParseFailure)


class DaemonError(Exception):
    """A refused request; the text is what the client reads in `Err`."""


# what refuses a request without anything written, as the client is told of it
REFUSED = (DaemonError, SessionElsewhere, LeaseLost, StoreError)


def refusal(e: Exception) -> Response:
    """The reply that tells a client its request was refused, from one of REFUSED."""
    if isinstance(e, SessionElsewhere):
        return Response.Elsewhere(e.session, e.address)
    return Response.Err(str(e))


class ContextTooLong(DaemonError):
    """A prompt longer than the model's window."""


class QueueListener:
    """Delivers a run's outcomes into an asyncio queue from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Outcome] = asyncio.Queue()

    def put(self, item: Outcome) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class Generation:
    """A Generate as its caller sees it: outcomes to read in order, and a way to stop it."""

    def __init__(
        self,
        listener: QueueListener | None,
        stop: Callable[[], None],
        immediate: Done | None = None,
        job: Job | None = None,
    ) -> None:
        self._listener = listener
        self._stop = stop
        self._immediate = immediate
        self._job = job

    @property
    def warm_prefix(self) -> int:
        """Prompt tokens that came from the cache: known once the generation has a lane (0 before)."""
        return self._job.warm_prefix if self._job is not None else 0

    async def next(self, timeout: float | None = None) -> Outcome | None:
        """The next outcome; None when `timeout` seconds pass without one."""
        if self._immediate is not None:
            return self._immediate
        assert self._listener is not None
        try:
            return await asyncio.wait_for(self._listener.queue.get(), timeout)
        except TimeoutError:
            return None

    async def __aiter__(self) -> AsyncIterator[Outcome]:
        while True:
            item = await self.next()
            assert item is not None
            yield item
            if isinstance(item, Done):
                return

    def cancel(self) -> None:
        """Stop the generation (it ends with finish 4); harmless once it has ended."""
        self._stop()


class CompletionSink:
    """Collects a fill-in-the-middle job's tokens; `done` resolves when it ends."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.done: asyncio.Future[tuple[int, str | None]] = self.loop.create_future()
        self.output: list[int] = []

    def tokens(self, job: Job, tokens: list[int]) -> None:
        self.output.extend(tokens)

    def finished(self, job: Job, finish: int, error: str | None) -> None:
        self.loop.call_soon_threadsafe(_resolve, self.done, (finish, error))


def _resolve(future: asyncio.Future[tuple[int, str | None]], value: tuple[int, str | None]) -> None:
    if not future.done():
        future.set_result(value)


class Daemon:
    """The sessions: the store, the models that generate, and the verbs between them.

    The session API generates with the default model; the HTTP routes name theirs.
    """

    def __init__(self, store: SessionStore, models: Models, *, metrics: Metrics) -> None:
        self.store = store
        self.models = models
        self.metrics = metrics
        self.bus = Bus()
        self.media = MediaStore(store.directory / "media")
        self.running: dict[int, GenerationRun] = {}
        self.generations = Generations(store, self._release, metrics)
        self.remote = RemoteCommits(store, self.bus)
        store.on_commit = self.bus.publish  # the EpochBump of a session taken back
        models.on_load = self._attach
        self._purging: set[int] = set()
        self._completions: OrderedDict[tuple[str, str, int, int], tuple[str, list[int]]] = OrderedDict()
        metrics.attach(self)
        self._handlers: dict[type, Callable[[Any], Response]] = {
            R.Create: self._create,
            R.Append: self._append,
            R.AppendMessage: self._append_message,
            R.AppendSystem: self._append_system,
            R.Read: self._read,
            R.List: self._list,
            R.Sessions: self._sessions,
            R.Tree: self._tree,
            R.Inspect: self._inspect,
            R.SetMeta: self._set_meta,
            R.Fork: self._fork,
            R.Rebase: self._rebase,
            R.Trim: self._trim,
            R.Cancel: self._cancel,
            R.SetQos: self._set_qos,
            R.Pin: self._pin,
            R.SetBackgroundRate: self._set_background_rate,
            R.SetLogLevel: self._set_log_level,
            R.Metrics: self._metrics,
            R.OpenToolCalls: self._open_tool_calls,
            R.Ledger: self._ledger,
            R.AppendToolResult: self._append_tool_result,
            R.AppendToolOutcome: self._append_tool_outcome,
            R.RequestToolCancel: self._request_tool_cancel,
            R.RequestPermission: self._request_permission,
            R.RespondPermission: self._respond_permission,
            R.AppendBlock: self._append_block,
            R.AppendImage: self._append_image,
            R.PutMedia: self._put_media,
            R.GcMedia: self._gc_media,
        }

    def _attach(self, runtime: Runtime) -> None:
        """A model was loaded: what its scheduler produces is committed at the end of its ticks."""
        scheduler = runtime.scheduler
        scheduler.on_tick = lambda: self.generations.on_tick(scheduler)

    @property
    def runtime(self) -> Runtime:
        """The default model, loaded."""
        return self.models.default()

    @property
    def model(self) -> LlamaModel:
        return self.runtime.model

    @property
    def template(self) -> ChatTemplate:
        return self.runtime.template

    @property
    def window(self) -> int:
        return self.runtime.window

    @property
    def scheduler(self) -> Scheduler:
        return self.runtime.scheduler

    def start(self) -> int:
        """Re-arm the pins of sessions the log holds; returns how many sessions it holds.

        Every other session waits in the log until it is first used (the store fences it then).
        """
        scheduler = self.scheduler
        for s in self.store.pinned():
            scheduler.pin(s.tokens, s.pin_deadline_unix_ms)
            scheduler.warm(s.tokens)
        return self.store.count()

    def stop(self) -> None:
        self.models.close()
        self.generations.stop()

    # ---- dispatch ----

    async def request(self, request: Any) -> Response:
        """Answer one non-streaming request."""
        started = time.perf_counter()
        name = type(request).__name__
        try:
            if isinstance(request, R.Purge):
                return await self._purge(request)
            if isinstance(request, R.Complete):
                return await self._complete(request)
            handler = self._handlers.get(type(request))
            if handler is None:
                raise DaemonError(f"{name} is not served by this version of superfluid")
            return handler(request)
        except REFUSED as e:
            return refusal(e)
        except (sqlite3.Error, OSError) as e:  # the disk refused: nothing was committed
            log.exception("%s failed to reach the disk", name)
            return Response.Err(f"io: {e}")
        finally:
            self.metrics.requests.labels(verb=name).inc()
            self.metrics.request_seconds.observe(time.perf_counter() - started)

    def _session(self, session_id: int, *, to_read: bool = False) -> SessionState:
        """A live session, served here from now on; `to_read`: wherever it is served (no lease taken)."""
        state = self.store.view(session_id) if to_read else self.store.get(session_id)
        if state is None:
            raise DaemonError(f"unknown session {session_id}")
        if state.purged:
            raise DaemonError(f"session {session_id} was purged")
        return state

    def _idle(self, state: SessionState) -> None:
        if state.id in self.running:
            raise DaemonError(f"session {state.id} is generating; append/generate after it finishes or cancel it")
        if state.id in self._purging:
            raise DaemonError(f"session {state.id} is being purged")

    def _commit_one(self, session_id: int, body: EventBody) -> EventMsg:
        (event,) = self.store.commit([(session_id, body)])
        self.bus.publish(session_id, [event])
        return event

    # ---- creating and appending ----

    def _create(self, req: R.Create) -> Response:
        _check_params(req.params)
        with self.store.lock:
            if req.parent is not None:
                self._session(req.parent)
            session = self.store.reserve_id()
            self.store.commit([(session, B.Created(req.parent, req.params))])
        return Response.Created(session)

    def open_chat(
        self,
        runtime: Runtime,
        params: GenParams,
        prompt: list[int],
        opener: list[int],
        qos: int,
        batch_invariant: bool = False,
    ) -> int:
        """A fresh session holding a whole rendered conversation, ready for `runtime` to generate (the HTTP APIs)."""
        _check_params(params)
        with self.store.lock:
            session = self.store.reserve_id()
            writes: list[tuple[int, EventBody]] = [(session, B.Created(None, params))]
            if qos != QOS_AGENT or batch_invariant:
                writes.append((session, B.QosSet(qos, batch_invariant)))
            writes.append((session, B.Appended(None, prompt)))
            # generated from at once: the fingerprint goes in this commit, not in one of its own
            writes.append((session, B.GenerationFingerprint(runtime.fingerprint)))
            if opener:
                writes.append((session, B.GenerationPrompt(opener)))
            self.store.commit(writes)
        return session

    def fork_chat(
        self,
        runtime: Runtime,
        parent: int,
        at_event: int,
        params: GenParams,
        messages: list[tuple[int, str]],
        qos: int,
        batch_invariant: bool = False,
    ) -> tuple[int, int]:
        """A child of `parent` after its event `at_event`, with `messages` (role, text) appended, ready for
        `runtime` to generate (the HTTP APIs' stored conversations): its id, and its prompt length with
        the assistant opener. Nothing is written for a prompt the model's window cannot hold."""
        _check_params(params)
        template = runtime.template
        with self.store.lock:
            state = self._session(parent)
            self._check_point(state, at_event)
            inherited = [e.body for e in state.events[:at_event] if isinstance(e.body, TOKEN_BEARING)]
            length = sum(len(body.span) for body in inherited)
            last_input = inherited[-1] if inherited else None
            turns: list[EventBody] = []
            for role, text in messages:
                span = self._message_span(length > 0, last_input, role, text, template)
                last_input = B.Message(role, text, span)
                turns.append(last_input)
                length += len(span)
            length += len(template.opener())
            if length >= runtime.window:
                raise ContextTooLong(
                    f"this model's maximum context length is {runtime.window} tokens, but your request has "
                    f"{length} tokens; shorten the prompt or drop earlier turns"
                )
            child = self.store.reserve_id()
            writes: list[tuple[int, EventBody]] = [(child, B.Forked(parent, at_event, params))]
            if (qos, batch_invariant) != (state.qos_class, state.batch_invariant):
                writes.append((child, B.QosSet(qos, batch_invariant)))
            self.store.commit(writes + [(child, turn) for turn in turns])
        return child, length

    def _append(self, req: R.Append) -> Response:
        with self.store.lock:
            state = self._session(req.session)
            self._idle(state)
            span = list(req.span) or self.model.tokenize(req.text or "", True)
            if not span:
                raise DaemonError("Append needs text or a non-empty span of token ids")
            bad = next((t for t in span if t >= self.model.n_vocab), None)
            if bad is not None:
                raise DaemonError(f"token id {bad} is outside the vocabulary (0..{self.model.n_vocab - 1})")
            return Response.Committed(self._commit_one(state.id, B.Appended(req.text, span)))

    def _append_message(self, req: R.AppendMessage) -> Response:
        if req.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {req.role}")
        with self.store.lock:
            state = self._session(req.session)
            self._idle(state)
            span = self._message_span(bool(state.tokens), state.last_input, req.role, req.text)
            return Response.Committed(self._commit_one(state.id, B.Message(req.role, req.text, span)))

    def _message_span(
        self, has_input: bool, last_input: EventBody | None, role: int, text: str, template: ChatTemplate | None = None
    ) -> list[int]:
        """A message's tokens after the given history (in `template`, the default model's if none): closing a
        finished turn first."""
        template = template or self.template
        try:
            finished = isinstance(last_input, B.Generated) and last_input.finish in TURN_ENDED
            separator = template.separator() if finished else []
            return separator + template.message(role, text, first=not has_input)
        except TemplateProblem as e:
            raise DaemonError(str(e)) from None

    def _append_system(self, req: R.AppendSystem) -> Response:
        if req.text is None and not req.tools:
            raise DaemonError("AppendSystem needs text, tools, or both")
        try:
            tools = normalize_tools(req.tools)
        except ToolDeclarationError as e:
            raise DaemonError(str(e)) from None
        with self.store.lock:
            state = self._session(req.session)
            self._idle(state)
            if state.tokens:
                raise DaemonError(
                    f"session {state.id} already has a prompt; AppendSystem must come before any other turn"
                )
            text = req.text or ""
            try:
                if not tools:
                    span = self.template.message(ROLE_SYSTEM, text, first=True)
                else:
                    span = self._system_with_tools(text, tools)
            except TemplateProblem as e:
                raise DaemonError(str(e)) from None
            return Response.Committed(self._commit_one(state.id, B.Message(ROLE_SYSTEM, text, span)))

    # ---- reading ----

    def _read(self, req: R.Read) -> Response:
        with self.store.lock:
            state = self._session(req.session, to_read=True)
            return Response.Events(state.events[req.cursor :])

    def _list(self, req: R.List) -> Response:
        with self.store.lock:
            return Response.Sessions([s.id for s in self.store.live()])

    def _sessions(self, req: R.Sessions) -> Response:
        with self.store.lock:
            return Response.SessionList(
                [self._summary(s) for s in self.store.live() if req.include_archived or not s.archived]
            )

    def _tree(self, req: R.Tree) -> Response:
        with self.store.lock:
            return Response.Tree([(s.id, s.parent, s.base) for s in self.store.live() if not s.archived])

    def _summary(self, s: SessionState) -> SessionSummary:
        return SessionSummary(
            s.id,
            s.parent,
            s.base,
            s.title,
            s.archived,
            s.meta_version,
            s.generation,
            len(s.events),
            len(s.tokens),
            len(s.open_calls),
        )

    def _inspect(self, req: R.Inspect) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            inspection = Inspection(
                summary=self._summary(s),
                params=s.params,
                epoch=s.epoch,
                last_finish=s.last_finish,
                qos_class=s.qos_class,
                batch_invariant=s.batch_invariant,
                pin_deadline_unix_ms=s.pin_deadline_unix_ms,
                behavior_fingerprint=s.fingerprint,
                open_tool_calls=[(call, name, args) for call, (name, args) in s.open_calls.items()],
                tier=self._tier(s),
                tokens=list(s.tokens),
                events=list(s.events),
                wal_version=2,
                store_id=self.store.store_id,
            )
            return Response.Inspection(inspection)

    def _tier(self, s: SessionState) -> Tier:
        """Resident while generating, Parked when the park holds a prefix of its tokens, else Cold."""
        if s.id in self.running:
            return Tier.Resident()
        park = self.scheduler.tiers.park
        found = park.lookup(np.asarray(s.tokens, dtype=np.int32), len(s.tokens)) if park and s.tokens else None
        return Tier.Parked(found[1], 0) if found else Tier.Cold()

    def _set_meta(self, req: R.SetMeta) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            if req.expected_version != s.meta_version:
                raise DaemonError(
                    f"session {s.id} metadata version is {s.meta_version}, command expected {req.expected_version}"
                )
            version = req.expected_version + 1
            self._commit_one(s.id, B.MetaUpdated(version, req.title, req.archived))
            return Response.Meta(version)

    # ---- branching ----

    def _fork(self, req: R.Fork) -> Response:
        if req.params is not None:
            _check_params(req.params)
        with self.store.lock:
            parent = self._session(req.session)
            self._check_point(parent, req.at_event)
            child = self.store.reserve_id()
            self.store.commit([(child, B.Forked(parent.id, req.at_event, req.params or parent.params))])
            return Response.Created(child)

    def _check_point(self, s: SessionState, n: int) -> None:
        if not 1 <= n <= s.next_id:
            raise DaemonError(f"fork point {n} is outside session {s.id}'s committed events (1..={s.next_id})")

    def _rebase(self, req: R.Rebase) -> Response:
        if req.params is not None:
            _check_params(req.params)
        with self.store.lock:
            parent = self._session(req.session)
            return Response.Created(self._rebase_into(parent, req.edits, req.params))

    def _trim(self, req: R.Trim) -> Response:
        with self.store.lock:
            parent = self._session(req.session)
            self._check_point(parent, req.to_event)
            if req.to_event == parent.next_id:
                return self._fork(R.Fork(parent.id, req.to_event, None))
            return Response.Created(self._rebase_into(parent, [RebaseEdit.Drop(req.to_event, parent.next_id)], None))

    def _rebase_into(self, parent: SessionState, edits: list[Any], params: GenParams | None) -> int:
        _check_edits(edits, parent.next_id)
        start = edits[0].from_
        child = self.store.reserve_id()
        writes: list[tuple[int, EventBody]] = [(child, B.Rebased(parent.id, start, params or parent.params, edits))]
        inherited = parent.events[:start]
        has_input = any(isinstance(e.body, TOKEN_BEARING) and e.body.span for e in inherited)
        last_input = next((e.body for e in reversed(inherited) if isinstance(e.body, TOKEN_BEARING)), None)
        calls = {e.event_id for e in inherited if isinstance(e.body, B.ToolUse)}
        remap: dict[int, int] = {}
        next_id = start + 1
        ranges = iter(edits)
        edit = next(ranges, None)
        for event in parent.events[start:]:
            while edit is not None and event.event_id >= edit.to:
                edit = next(ranges, None)
            body: EventBody | None
            if edit is not None and edit.from_ <= event.event_id < edit.to:
                if not (isinstance(edit, RebaseEdit.Replace) and event.event_id == edit.from_):
                    continue
                span = self._message_span(has_input, last_input, edit.role, edit.text)
                body = B.Message(edit.role, edit.text, span)
            else:
                body = _copy(event, calls, remap)
            if body is None:
                continue
            if isinstance(body, B.ToolUse):
                remap[event.event_id] = next_id
                calls.add(next_id)
            if isinstance(body, TOKEN_BEARING):
                has_input = has_input or bool(body.span)
                last_input = body
            writes.append((child, body))
            next_id += 1
        self.store.commit(writes)
        return child

    # ---- generation ----

    def _system_with_tools(self, text: str, tools: list[dict[str, Any]]) -> list[int]:
        """A first system turn declaring `tools`: through the template where it renders one such turn on its
        own, else (a template that knows no tools, or puts the system text in a later turn) in our words."""
        template = self.template
        if template.supports_tools:
            with contextlib.suppress(TemplateProblem):
                return template.framed(template.system_with_tools(tools), text, first=True)
        return template.message(ROLE_SYSTEM, fallback_system_text(text, tools, template.dialect), first=True)

    def grammar_for(self, *, gbnf: Any = None, json_schema: Any = None, tool: Any = None) -> str | None:
        """The GBNF of a constraint given as a grammar, a JSON schema, or a tool to call (at most one)."""
        given = [name for name, value in (("grammar", gbnf), ("json_schema", json_schema), ("tool", tool)) if value]
        if len(given) > 1:
            raise DaemonError(f"give one constraint, not {' and '.join(given)}")
        try:
            if gbnf is not None:
                if not isinstance(gbnf, str):
                    raise DaemonError("grammar must be GBNF text with a `root` rule")
                return gbnf
            if json_schema is not None:
                return schema_grammar(json_schema)
            if tool is not None:
                function = normalize_tool(tool)["function"]
                template = self.template
                return tool_call_grammar(
                    [(function["name"], function["parameters"])],
                    template.dialect.shape,
                    prefix=template.reasoning_left_open(),
                )
        except (GrammarError, ToolDeclarationError) as e:
            raise DaemonError(str(e)) from None
        return None

    def generate(
        self,
        req: R.Generate,
        *,
        provisional: bool,
        grammar: str | None = None,
        runtime: Runtime | None = None,
        shaping: Shaping | None = None,
    ) -> Generation:
        """Start a generation on `runtime` (the default model); its outcomes arrive by iterating
        the returned `Generation`.

        `grammar` (GBNF) constrains every token; the generation ends with finish 3 when it is complete.
        `shaping` (the HTTP APIs' logit bias, penalties and log probabilities) applies to this generation only.
        """
        runtime = runtime or self.runtime
        model, template, window = runtime.model, runtime.template, runtime.window
        if grammar is not None:
            try:
                Grammar(model, grammar).close()  # it parses here; the engine keeps its state
            except GrammarError as e:
                raise DaemonError(str(e)) from None
        with self.store.lock:
            s = self._session(req.session)
            if s.id in self._purging:
                raise DaemonError(f"session {s.id} is being purged")
            if s.permissions:
                raise DaemonError(f"session {s.id} has an open permission request; answer it before generating")
            if not s.tokens:
                raise DaemonError(f"session {s.id} has no content to generate from")
            opener = _opener(template, s.last_input)
            total = len(s.tokens) + len(opener)
            if total >= window:
                raise DaemonError(
                    f"this model's maximum context length is {window} tokens, but your request has "
                    f"{total} tokens; shorten the prompt or drop earlier turns"
                )
            if req.max_tokens == 0:
                return Generation(None, lambda: None, Done([], 0, 0, 0))
            self._idle(s)
            writes: list[tuple[int, EventBody]] = []
            if s.fingerprint != runtime.fingerprint:
                writes.append((s.id, B.GenerationFingerprint(runtime.fingerprint)))
            if opener:
                writes.append((s.id, B.GenerationPrompt(opener)))
            if writes:
                self.bus.publish(s.id, self.store.commit(writes))
            splitter = ChannelSplitter(model.pieces, template.dialect.markers)
            # the turn so far: its opener may open a channel (a template that starts the reply thinking)
            turn = opener or _open_turn(s)
            splitter.prime(turn, fresh=bool(opener) or not _turn_has_text(s))
            listener = QueueListener()
            run = GenerationRun(
                s.id,
                list(s.tokens),
                s.params,
                req.max_tokens,
                qos=s.qos_class,
                batch_invariant=s.batch_invariant,
                splitter=splitter,
                listener=listener,
                provisional=provisional,
                publisher=self.bus,
                ignore_eos=bool(req.ignore_eos),
                dialect=template.dialect,
            )
            job = run.job
            job.grammar = grammar
            job.shaping = shaping if shaping is not None and shaping.needed else None
            run.scheduler = scheduler = runtime.scheduler
            self.running[s.id] = run
            self.generations.add(run)
            self.metrics.generations.inc()
        scheduler.submit(job)
        return Generation(listener, lambda: scheduler.cancel(job), job=job)

    def _release(self, run: GenerationRun) -> None:
        """Committer thread: the run's last event is durable; the session takes requests again."""
        with self.store.lock:
            if self.running.get(run.session) is run:
                del self.running[run.session]
        self.metrics.tokens_generated.inc(run.job.generated)
        self.metrics.warm_prefix_tokens.inc(run.job.warm_prefix)

    def _cancel(self, req: R.Cancel) -> Response:
        run = self.running.get(req.session)
        if run is None:
            self._session(req.session)
            raise DaemonError(f"session {req.session} has no generation in flight")
        run.cancel()
        return Response.Cancelling()

    # ---- scheduling ----

    def _set_qos(self, req: R.SetQos) -> Response:
        if req.class_ > 3:
            raise DaemonError(f"unknown QoS class {req.class_} (0 interactive .. 3 background)")
        with self.store.lock:
            s = self._session(req.session)
            event = self._commit_one(s.id, B.QosSet(req.class_, req.batch_invariant))
        log.debug("session %d qos %s", s.id, QOS_NAMES[req.class_])
        return Response.Committed(event)

    def _pin(self, req: R.Pin) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            deadline = now_ms() + req.ttl_ms if req.ttl_ms else 0
            self._commit_one(s.id, B.Pinned(deadline))
            self.scheduler.pin(s.tokens, deadline)
            return Response.Pinned(deadline)

    def _set_background_rate(self, req: R.SetBackgroundRate) -> Response:
        self.scheduler.background_divisor = max(req.divisor, 1)
        return Response.Ack()

    def _set_log_level(self, req: R.SetLogLevel) -> Response:
        try:
            set_log_directive(req.directive)
        except ValueError as e:
            raise DaemonError(f"generation failed: {e}") from None
        return Response.Ack()

    def _metrics(self, req: R.Metrics) -> Response:
        return Response.Text(self.metrics.exposition())

    # ---- tools ----

    def _open_tool_calls(self, req: R.OpenToolCalls) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            return Response.ToolCalls([(call, name, args) for call, (name, args) in s.open_calls.items()])

    def _ledger(self, req: R.Ledger) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            return Response.Ledger([(call, entry.entry()) for call, entry in s.ledger.items()])

    def _tool_call(self, s: SessionState, call_id: int) -> ToolCallState:
        """The session's own ledger entry of `call_id`, or the Err the protocol gives."""
        call = s.ledger.get(call_id)
        if call is None:
            inherited = call_id < s.base and isinstance(_body_at(s, call_id), B.ToolUse)
            if inherited:
                raise DaemonError(
                    f"tool call {call_id} belongs to an ancestor's timeline; only that session can close it"
                )
            raise DaemonError(f"tool call {call_id} is unknown or already closed")
        return call

    def _append_tool_result(self, req: R.AppendToolResult) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            call = self._tool_call(s, req.call_id)
            if call.state == LEDGER_SUCCEEDED:
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            if call.state not in (LEDGER_OPEN, LEDGER_CANCEL_REQUESTED):
                note = f"late result: {len(req.content.encode())} bytes"
                self._commit_one(s.id, B.ToolReconciliation(req.call_id, note))
                raise DaemonError(
                    f"tool call {req.call_id} already reached a terminal outcome; "
                    "the late result was recorded as a reconciliation"
                )
            span = self._message_span(True, s.last_input, ROLE_TOOL, req.content)
            return Response.Committed(self._commit_one(s.id, B.ToolResult(req.call_id, req.content, span)))

    def _append_tool_outcome(self, req: R.AppendToolOutcome) -> Response:
        if req.outcome not in (OUTCOME_FAILED, OUTCOME_CANCELLED):
            raise DaemonError(f"unknown tool outcome {req.outcome} (1 failed, 2 cancelled)")
        with self.store.lock:
            s = self._session(req.session)
            call = self._tool_call(s, req.call_id)
            if call.state not in (LEDGER_OPEN, LEDGER_CANCEL_REQUESTED):
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            event = self._commit_one(s.id, B.ToolOutcome(req.call_id, req.outcome, req.note))
            return Response.Committed(event)

    def _request_tool_cancel(self, req: R.RequestToolCancel) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            call = self._tool_call(s, req.call_id)
            if call.state not in (LEDGER_OPEN, LEDGER_CANCEL_REQUESTED):
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            return Response.Committed(self._commit_one(s.id, B.ToolCancelRequested(req.call_id)))

    def _request_permission(self, req: R.RequestPermission) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            if req.call_id != 0 and req.call_id not in s.open_calls:
                raise DaemonError(f"tool call {req.call_id} is unknown or already closed")
            return Response.Committed(self._commit_one(s.id, B.PermissionRequest(req.call_id, req.text)))

    def _respond_permission(self, req: R.RespondPermission) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            if req.request_id not in s.permissions:
                raise DaemonError(f"permission request {req.request_id} is unknown or already answered")
            event = self._commit_one(s.id, B.PermissionResponse(req.request_id, req.granted))
            return Response.Committed(event)

    # ---- blocks and images ----

    def _append_block(self, req: R.AppendBlock) -> Response:
        if req.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {req.role}")
        try:
            projection = project_block(req.kind, req.payload)
        except BlockError as e:
            raise DaemonError(str(e)) from None
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            span = self._message_span(bool(s.tokens), s.last_input, req.role, projection)
            block = B.Block(req.role, req.kind, req.payload, span, MODEL_VISIBILITY_VERSION)
            return Response.Committed(self._commit_one(s.id, block))

    def _append_image(self, req: R.AppendImage) -> Response:
        if req.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {req.role}")
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            if not self.media.has(req.blob):
                raise DaemonError(f"media blob {req.blob} is not in the pool (put it first)")
            raise DaemonError(
                f"{self.model.name} is a text-only model: it has no vision projector, so it cannot take "
                "images; serve a vision GGUF to use AppendImage"
            )

    # ---- subscriptions ----

    def subscribe(self, session: int, cursor: int, provisional: bool) -> Subscription:
        """Attach a subscriber: the backlog from `cursor`, then live events, deduplicated by id."""
        with self.store.lock:
            state = self._session(session, to_read=True)
            sub = self.bus.subscribe(session, cursor, provisional, lambda c: state.events[c:])
        self.remote.watch(session, max(cursor, state.next_id))
        return sub

    # ---- media ----

    def _put_media(self, req: R.PutMedia) -> Response:
        try:
            return Response.Media(self.media.put(req.bytes))
        except OSError as e:
            raise DaemonError(f"io: {e}") from None

    def _gc_media(self, req: R.GcMedia) -> Response:
        with self.store.lock:
            referenced = {
                blob
                for s in self.store.live()
                for e in s.events
                if isinstance(e.body, B.Block) and e.body.kind == BLOCK_IMAGE
                for blob in [_image_blob(e.body.payload)]
                if blob
            }
            kept, removed = self.media.gc(referenced)
        return Response.Gc(kept, removed)

    # ---- fill in the middle ----

    async def _complete(self, req: R.Complete) -> Response:
        """Fill in the middle, greedy, on `--fim-model`'s model (else the default), with the prompt the
        HTTP routes build too (`fim.fim_prompt`)."""
        try:
            runtime = await asyncio.to_thread(fim_runtime, self.models)
            check_fim(runtime.model, req.mode)
        except FimError as e:
            raise DaemonError(str(e)) from None
        key = (req.prefix, req.suffix, req.mode, req.max_tokens)
        cached = self._completions.get(key)
        if cached is not None:
            self._completions.move_to_end(key)
            self.metrics.fim_completions.labels(result="cached").inc()
            return Response.Completion(cached[0], cached[1], True, False)
        prompt = fim_prompt(runtime.model, req.prefix, req.suffix, req.mode)
        if len(prompt) >= runtime.window:
            raise DaemonError(
                f"this model's maximum context length is {runtime.window} tokens, but your request has "
                f"{len(prompt)} tokens; shorten the prompt or drop earlier turns"
            )
        tokens: list[int] = []
        if req.max_tokens > 0:
            sink = CompletionSink()
            job = Job(prompt, GREEDY, req.max_tokens, sink=sink, qos=QOS_COMPLETION)
            scheduler = runtime.scheduler
            scheduler.submit(job)
            try:
                _, error = await sink.done
            except asyncio.CancelledError:
                scheduler.cancel(job)
                raise
            if error:
                raise DaemonError(error)
            tokens = sink.output
        text = runtime.model.detokenize(tokens)
        self._completions[key] = (text, tokens)
        while len(self._completions) > COMPLETION_CACHE:
            self._completions.popitem(last=False)
        self.metrics.fim_completions.labels(result="generated").inc()
        return Response.Completion(text, tokens, False, False)

    # ---- purge ----

    async def _purge(self, req: R.Purge) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            if req.expected_generation != s.generation:
                raise DaemonError(
                    f"session {s.id} generation is {s.generation}, command expected {req.expected_generation}"
                )
            cascade = isinstance(req.mode, PurgeMode.Cascade)
            descendants = self._descendants(s) if cascade else []
            targets = [*descendants, s.id]
            if self._purging.intersection(targets):
                raise DaemonError(f"session {s.id} is being purged")
            self._purging.update(targets)
        try:
            await self._quiesce(targets)
            with self.store.lock:
                writes: list[tuple[int, EventBody]] = []
                for target in targets:
                    state = self._session(target)
                    writes += [(target, B.ToolExpired(call, "purged")) for call in state.open_calls]
                if not cascade:
                    for child_id in list(s.children):
                        child = self.store.get(child_id)
                        if child is not None and not child.purged:
                            prefix = [(e.event_id, e.body) for e in child.events[: child.base]]
                            writes.append((child_id, B.Rerooted(s.id, prefix)))
                for target in targets:
                    state = self._session(target)
                    writes.append((target, B.Purged(state.generation + 1, req.mode)))
                self.store.commit(writes)
        finally:
            self._purging.difference_update(targets)
        for target in targets:
            self.bus.end_session(target, END_PURGED)
        return Response.Purged(targets)

    def _descendants(self, s: SessionState) -> list[int]:
        """Every live descendant, deepest first (reverse depth-first order)."""
        order: list[int] = []
        stack = [s]
        while stack:
            node = stack.pop()
            for child_id in node.children:
                child = self.store.get(child_id)
                if child is not None and not child.purged:
                    order.append(child_id)
                    stack.append(child)
        return order[::-1]

    async def _quiesce(self, targets: list[int]) -> None:
        for target in targets:
            run = self.running.get(target)
            if run is not None:
                run.cancel()
        deadline = time.monotonic() + PURGE_WAIT_S
        while any(t in self.running for t in targets):
            if time.monotonic() > deadline:
                busy = next(t for t in targets if t in self.running)
                raise DaemonError(f"session {busy} did not quiesce for purge (lane still running)")
            await asyncio.sleep(0.005)


def _check_params(params: GenParams) -> None:
    """Sampling parameters the sampler can use: finite, temperature >= 0, top_p and min_p in [0, 1]."""
    for name, value, top in (
        ("temperature", params.temperature, math.inf),
        ("top_p", params.top_p, 1.0),
        ("min_p", params.min_p, 1.0),
    ):
        if not (math.isfinite(value) and 0.0 <= value <= top):
            accepted = "a finite number of at least 0" if top == math.inf else "a number from 0 to 1"
            raise DaemonError(f"params.{name} must be {accepted}, not {value}")


def _check_edits(edits: list[Any], next_id: int) -> None:
    def invalid(why: str) -> DaemonError:
        return DaemonError(f"rebase edit spec invalid: {why}")

    if not edits:
        raise invalid("no edits")
    previous_end = 0
    for edit in edits:
        if edit.from_ == 0:
            raise invalid("edits never include Created (id 0)")
        if edit.from_ >= edit.to:
            raise invalid("empty range")
        if edit.to > next_id:
            raise invalid("range beyond the parent's committed events")
        if edit.from_ < previous_end:
            raise invalid("ranges must be sorted and non-overlapping")
        if isinstance(edit, RebaseEdit.Replace) and edit.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {edit.role}")
        previous_end = edit.to


def _copy(event: EventMsg, calls: set[int], remap: dict[int, int]) -> EventBody | None:
    """The record a rebased branch gets for one of its parent's later events, or None."""
    body = event.body
    if isinstance(
        body, (B.Appended, B.Message, B.GenerationPrompt, B.Generated, B.ToolUse, B.ToolParseFailure, B.Block)
    ):
        return body
    if isinstance(body, B.ToolResult):
        call = remap.get(body.call_id, body.call_id)
        if call in calls:
            return B.ToolResult(call, body.content, body.span)
        return B.Message(3, body.content, body.span)
    return None


def _body_at(s: SessionState, event_id: int) -> EventBody | None:
    return s.events[event_id].body if 0 <= event_id < len(s.events) else None


def _opener(template: ChatTemplate, last_input: EventBody | None) -> list[int]:
    """The assistant opener a generation needs, or none when it continues an open turn."""
    if isinstance(last_input, B.Generated):
        return template.separator() + template.opener() if last_input.finish in TURN_ENDED else []
    if isinstance(last_input, (B.Message, B.ToolResult, B.Block)):
        return template.opener()
    return []


def _open_turn(s: SessionState) -> list[int]:
    """The tokens of the turn a continuation extends: from its opener, or after the last input turn."""
    tokens: list[int] = []
    for event in reversed(s.events):
        body = event.body
        if isinstance(body, (B.Message, B.ToolResult, B.Block)):
            break
        if isinstance(body, (B.Appended, B.GenerationPrompt, B.Generated)):
            tokens[:0] = body.span
        if isinstance(body, B.GenerationPrompt):
            break
    return tokens


def _turn_has_text(s: SessionState) -> bool:
    """Whether the open turn a continuation extends has text already (a leading call can no longer open)."""
    for event in reversed(s.events):
        body = event.body
        if isinstance(body, (B.Message, B.ToolResult, B.Block, B.GenerationPrompt)):
            return False
        if isinstance(body, B.Generated) and body.channel == CHANNEL_TEXT and body.text.strip():
            return True
    return False


def _image_blob(payload: str) -> str | None:
    try:
        blob = json.loads(payload).get("blob")
    except (ValueError, AttributeError):
        return None
    return blob if isinstance(blob, str) else None
