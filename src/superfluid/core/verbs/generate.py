"""Generation verbs: Generate (for the socket, the browser and the HTTP APIs alike), Cancel and Complete.

`generate` is the one way a generation starts: it checks the grammar and the context window,
commits the turn's opener on the daemon's writer thread (never on the event loop), and submits
the job; its outcomes come back through a `Generation`. HTTP streams what is sampled at once
(provisional: a crash may still lose it), the socket only what is committed. A generation started
for a request that has an access line (`telemetry.access_log.current`) is attached to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from ...engine.grammar import Grammar, GrammarError
from ...engine.shaping import Shaping
from ...model.channels import ChannelSplitter
from ...model.template import ChatTemplate
from ...protocol.schema import (
    CHANNEL_TEXT,
    QOS_AGENT,
    QOS_COMPLETION,
    TOKEN_BEARING,
    EventBody,
    GenParams,
    Request,
    Response,
)
from ...scheduler.job import Job
from ...store.state import SessionState
from ...telemetry.access_log import AccessRecord, current
from ..errors import DaemonError, check_fits
from ..fim import FimError, check_fim, fim_prompt, fim_runtime
from ..generation import Done, GenerationRun, Outcome
from ..runtime import Runtime
from .base import TURN_ENDED, DaemonBase, _check_params

B = EventBody
R = Request

COMPLETION_CACHE = 256
GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)
# Records a Generate streams to its caller as they commit.
STREAMED = (B.Generated, B.ToolUse, B.ToolResult, B.ToolParseFailure)


class QueueListener:
    """Delivers a run's outcomes into an asyncio queue from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
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


class GenerationVerbs(DaemonBase):
    """Starting, cancelling and answering generations."""

    def open_chat(
        self,
        runtime: Runtime,
        params: GenParams,
        prompt: list[int],
        opener: list[int],
        qos: int,
        batch_invariant: bool = False,
    ) -> int:
        """A fresh session holding a whole rendered conversation, ready for `runtime` to generate (the HTTP APIs).
        Nothing is written for a prompt the model's window cannot hold."""
        _check_params(params)
        check_fits(runtime.window, len(prompt) + len(opener))
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
            check_fits(runtime.window, length)
            child = self.store.reserve_id()
            writes: list[tuple[int, EventBody]] = [(child, B.Forked(parent, at_event, params))]
            if (qos, batch_invariant) != (state.qos_class, state.batch_invariant):
                writes.append((child, B.QosSet(qos, batch_invariant)))
            self.store.commit(writes + [(child, turn) for turn in turns])
        return child, length

    async def generate(
        self,
        req: R.Generate,
        *,
        provisional: bool,
        grammar: str | None = None,
        runtime: Runtime | None = None,
        shaping: Shaping | None = None,
    ) -> Generation:
        """Start a generation on `runtime` (the default model); its outcomes arrive by iterating
        the returned `Generation`. What it commits first (the turn's opener) is written on the
        daemon's writer thread: the event loop goes on meanwhile.

        `grammar` (GBNF) constrains every token; the generation ends with finish 3 when it is complete.
        `shaping` (the HTTP APIs' logit bias, penalties and log probabilities) applies to this generation only.
        """
        listener = QueueListener(asyncio.get_running_loop())
        record = current()  # read here, in the request's context: the writer thread has none
        return await self.written(self._start, req, listener, provisional, grammar, runtime, shaping, record)

    def _start(
        self,
        req: R.Generate,
        listener: QueueListener,
        provisional: bool,
        grammar: str | None,
        runtime: Runtime | None,
        shaping: Shaping | None,
        record: AccessRecord | None,
    ) -> Generation:
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
            check_fits(window, len(s.tokens) + len(opener))
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
            if record is not None:
                record.attach(run, runtime.id)
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
        check_fits(runtime.window, len(prompt))
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
