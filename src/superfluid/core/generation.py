"""Generations in flight: sampled tokens in, committed events out.

A `GenerationRun` is one Generate on one session. The scheduler thread feeds it tokens
(classified into channels as they come, and offered as provisional text, with the log
probabilities of the text's tokens when the job asked for them: the first piece at once,
then gathered for up to `HAND_OVER_S`); at
the end of each scheduler tick `Generations.on_tick` gathers every run's new tokens
into `Generated` records (one per channel run) and hands them to the committer thread,
which writes the whole tick in one transaction and only then delivers the events.
Nothing reaches a listener before it is on disk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..engine.shaping import LogprobRow
from ..metrics import Metrics
from ..model.channels import ChannelSplitter, Piece
from ..model.dialects import HERMES, Dialect
from ..protocol.schema import (
    CHANNEL_REASONING,
    CHANNEL_TEXT,
    CHANNEL_TOOL_CALL,
    FINISH_ERROR,
    FINISH_GRAMMAR,
    FINISH_STOP,
    EventBody,
    EventMsg,
    GenParams,
)
from ..scheduler.job import QUIET, Job
from ..scheduler.scheduler import Scheduler
from ..store.leases import LeaseLost
from ..store.sessions import SessionStore
from .bus import Committed, Provisional

log = logging.getLogger("superfluid.core.generation")
# text ahead of its commit reaches a listener at most this often, in one piece (the first at once):
# the tokens of one decode (drafts that stood) come microseconds apart and go out together, while
# decodes (5 ms and more apart, a run's too: `Step.on_decode`) each go out as they end. At 40 ms a
# lone stream's chunks came 80-88 ms apart at p99 against llama-server's 13-20 ms (embedded model),
# for no throughput measured
HAND_OVER_S = 0.005
B = EventBody


@dataclass(frozen=True)
class Done:
    """The generation ended; `events` are every event it delivered, in order. A generation
    that failed ends with finish 5 and says why in `error`."""

    events: list[EventMsg]
    tokens_generated: int
    finish: int
    warm_prefix: int
    error: str | None = None
    spec: tuple[int, int] = (0, 0)  # drafted tokens proposed and accepted (speculative decoding)


Outcome = Committed | Provisional | Done


class Listener(Protocol):
    """Where a run's outcomes go; `put` is called from daemon threads."""

    def put(self, item: Outcome) -> None: ...


class Publisher(Protocol):
    """The session event bus: committed events and provisional text, per session."""

    def publish(self, session: int, events: list[EventMsg]) -> None: ...

    def provisional(self, session: int, channel: int, text: str) -> None: ...


class GenerationRun:
    """One Generate on one session, from submission to its last committed event."""

    def __init__(
        self,
        session: int,
        tokens: list[int],
        params: GenParams,
        max_tokens: int,
        *,
        qos: int,
        batch_invariant: bool,
        splitter: ChannelSplitter,
        listener: Listener,
        provisional: bool,
        publisher: Publisher,
        ignore_eos: bool = False,
        dialect: Dialect = HERMES,
    ) -> None:
        self.session = session
        self.job = Job(
            tokens,
            params,
            max_tokens,
            sink=self,
            qos=qos,
            batch_invariant=batch_invariant,
            ignore_eos=ignore_eos,
            session=session,
        )
        self.splitter = splitter
        self.dialect = dialect  # reads the calls the splitter closes
        self.listener = listener
        self.provisional = provisional
        self.publisher = publisher
        self.delivered: list[EventMsg] = []
        self.finish: int | None = None
        self.error: str | None = None
        self.failure: str | None = None  # why a commit of its records was refused: it ends with finish 5
        self._pending: list[Piece] = []
        self._held: Provisional | None = None  # text for the listener, gathered between two hand-overs
        self._handed_at = 0.0
        self._rows: deque[LogprobRow] = deque()  # of tokens the splitter holds back, in order
        self.submitted = time.monotonic()
        self.first_commit: float | None = None
        self.scheduler: Scheduler | None = None  # the one its job was submitted to
        # told on the committer thread that the run ended, before its caller is (an access log line waits for it)
        self.on_done: Callable[[GenerationRun], None] | None = None

    def cancel(self) -> None:
        """Stop the generation at the next step (it ends with finish 4)."""
        if self.scheduler is not None:
            self.scheduler.cancel(self.job)

    @property
    def has_output(self) -> bool:
        return bool(self._pending) or self._held is not None or self.finish is not None

    # ---- scheduler thread ----

    def tokens(self, job: Job, tokens: list[int]) -> None:
        self._rows.extend(job.logprobs)  # one per token when the job asked for them
        job.logprobs.clear()
        for token in tokens:
            for piece in self.splitter.feed(token):
                self._pending.append(piece)
                self._show(piece)

    def _show(self, piece: Piece) -> None:
        """Hand a piece of text or reasoning to whoever watches it before it is committed."""
        rows = tuple(self._rows.popleft() for _ in piece.tokens if self._rows)
        if piece.channel != CHANNEL_TEXT:
            rows = ()  # log probabilities describe the reply's content
        if (piece.text or rows) and piece.channel in (CHANNEL_TEXT, CHANNEL_REASONING):
            if self.provisional:
                self._hold(Provisional(piece.channel, piece.text, rows))
            if piece.text:
                self.publisher.provisional(self.session, piece.channel, piece.text)

    def _hold(self, item: Provisional) -> None:
        """Hand text to the listener at most every `HAND_OVER_S` (the first piece at once).

        Each hand-over wakes the listener's event loop, and on a machine whose cores all run
        llama.cpp that wake-up is taken from the decode: one per token slowed a lone stream by a
        few percent against the same request unstreamed.
        """
        held = self._held
        if held is not None and held.channel == item.channel:
            item = Provisional(item.channel, held.text + item.text, held.logprobs + item.logprobs)
        else:
            self._hand_over()
        self._held = item
        if time.monotonic() - self._handed_at >= HAND_OVER_S:
            self._hand_over()

    def _hand_over(self) -> None:
        if self._held is not None:
            self.listener.put(self._held)
            self._held = None
            self._handed_at = time.monotonic()

    def finished(self, job: Job, finish: int, error: str | None) -> None:
        self.finish, self.error = (FINISH_ERROR, self.failure) if self.failure is not None else (finish, error)

    def drain(self) -> list[EventBody]:
        """The records of the tokens since the last drain: one `Generated` per channel run,
        a `ToolUse` (or `ToolParseFailure`) after each closed call, and at the end of the
        generation a last `Generated` that carries the finish code."""
        pieces, self._pending = self._pending, []
        if self.finish is not None:
            tail = self.splitter.flush()  # what was held back in case it began a marker
            for piece in tail:
                self._show(piece)
            pieces += tail
        self._hand_over()  # the tick's text goes out before its commit
        bodies: list[EventBody] = []
        channel = self.splitter.channel
        span: list[int] = []
        text: list[str] = []
        for piece in pieces:
            if (span or text) and piece.channel != channel:
                bodies.append(B.Generated(span, "".join(text), channel, 0))
                span, text = [], []
            channel = piece.channel
            span += piece.tokens
            text.append(piece.text)
            if piece.closes:
                bodies.append(B.Generated(span, "".join(text), channel, 0))
                span, text = [], []
                if piece.call is not None:
                    bodies += self._call_records(piece.call)
        if span or text:
            bodies.append(B.Generated(span, "".join(text), channel, 0))
        if self.finish is not None:
            if self.splitter.channel == CHANNEL_TOOL_CALL and self.finish in (FINISH_STOP, FINISH_GRAMMAR):
                bodies += self._call_records(self.splitter.call_text)  # the generation ended the call
            last = bodies[-1] if bodies else None
            if isinstance(last, B.Generated):
                bodies[-1] = B.Generated(last.span, last.text, last.channel, self.finish)
            else:
                bodies.append(B.Generated([], "", self.splitter.channel, self.finish))
        return bodies

    def _call_records(self, call_text: str) -> list[EventBody]:
        """A `ToolUse` per call of a closed section; a `ToolParseFailure` with its text when none reads."""
        parsed = self.dialect.parse(call_text)
        if parsed is None:
            log.warning(
                "session %d: a %s tool call that does not parse, kept as text: %.200r",
                self.session,
                self.dialect.name,
                call_text,
            )
            return [B.ToolParseFailure(call_text)]
        return [B.ToolUse(call.name, call.arguments) for call in parsed]

    # ---- committer thread ----

    def deliver(self, events: list[EventMsg]) -> None:
        self.delivered.extend(events)
        for event in events:
            self.listener.put(Committed(event))
        self.publisher.publish(self.session, events)

    def conclude(self) -> None:
        error = (self.error or "generation failed") if self.finish == FINISH_ERROR else None
        job = self.job
        drafts = (job.spec_proposed, job.spec_accepted)
        # the run, its job and the access record that follows it hold one another: let go, so they are freed
        # with the last reference to them (each run's delivered events with them), not by the cyclic collector
        job.sink = QUIET
        on_done, self.on_done = self.on_done, None
        if on_done is not None:
            on_done(self)
        self.listener.put(Done(list(self.delivered), job.generated, self.finish or 0, job.warm_prefix, error, drafts))


# a run's records of one tick, and whether they are its last
TickWrites = tuple[GenerationRun, list[EventBody], bool]


class Generations:
    """Every run in flight, and the committer thread that makes their output durable."""

    def __init__(self, store: SessionStore, release: Callable[[GenerationRun], None], metrics: Metrics) -> None:
        self.store = store
        self.metrics = metrics
        self._release = release
        self._runs: list[GenerationRun] = []
        self._runs_lock = threading.Lock()
        self._queue: queue.SimpleQueue[list[TickWrites] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._commit_loop, name="superfluid-committer", daemon=True)
        self._thread.start()

    def add(self, run: GenerationRun) -> None:
        with self._runs_lock:
            self._runs.append(run)

    def on_tick(self, scheduler: Scheduler) -> None:
        """A scheduler's thread, at the end of each of its ticks: queue the tick's records for commit."""
        with self._runs_lock:
            runs = [run for run in self._runs if run.scheduler is scheduler]
        batch = []
        for run in runs:
            if not run.has_output:
                continue
            final = run.finish is not None
            bodies = run.drain()
            if bodies or final:
                batch.append((run, bodies, final))
            if final:
                with self._runs_lock:
                    self._runs.remove(run)
        if batch:
            self._queue.put(batch)

    def _commit_loop(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            started = time.perf_counter()
            batch, events = self._commit(batch)
            if not batch:
                continue
            self.metrics.commit_seconds.observe(time.perf_counter() - started)
            committed = time.time_ns()
            offset = 0
            for run, bodies, final in batch:
                times = run.job.times
                if times is not None:
                    times.commits += 1
                    times.committed = committed
                if run.first_commit is None and bodies:
                    run.first_commit = time.monotonic()
                    self.metrics.ttft_seconds.observe(run.first_commit - run.submitted)
                run.deliver(events[offset : offset + len(bodies)])
                offset += len(bodies)
                if final:
                    self._release(run)
                    run.conclude()

    def _commit(self, batch: list[TickWrites]) -> tuple[list[TickWrites], list[EventMsg]]:
        """Commit a tick's records in one transaction: the runs whose writes were committed, and the
        events. The runs of sessions whose lease this daemon lost fail alone; the others commit
        without them. When the store refuses the whole tick, nothing of it is durable. A run that
        failed writes nothing more: its later ticks, queued already, would leave a hole in its turn."""
        self._fail([item for item in batch if item[0].failure is not None], "")
        batch = [item for item in batch if item[0].failure is None]
        while batch:
            try:
                return batch, self.store.commit([(run.session, body) for run, bodies, _ in batch for body in bodies])
            except LeaseLost as e:
                self._fail([item for item in batch if item[0].session in e.sessions], str(e))
                batch = [item for item in batch if item[0].session not in e.sessions]
            except Exception as e:  # the disk or the database refused
                log.exception("committing a tick failed")
                self._fail(batch, f"io: {e}")
                return [], []
        return [], []

    def _fail(self, batch: list[TickWrites], why: str) -> None:
        for run, _, final in batch:
            run.failure = run.failure or why
            run.job.cancelled = True
            if final:
                run.finish, run.error = FINISH_ERROR, run.failure
                self._release(run)
                run.conclude()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
