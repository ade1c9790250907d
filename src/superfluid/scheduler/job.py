"""A generation as the scheduler runs it: the `Job` a caller submits, the `Lane` it runs on, the sink it feeds,
and the times of its phases (`JobTimes`) for its access log line and its trace."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.shaping import LogprobRow, Shaping
from ..protocol.schema import QOS_AGENT, GenParams


class JobSink(Protocol):
    """Receives a job's output on the scheduler thread."""

    def tokens(self, job: Job, tokens: list[int]) -> None: ...

    def finished(self, job: Job, finish: int, error: str | None) -> None: ...


class QuietSink:
    """A sink that takes nothing: a prefill-only job's, and a concluded generation's (whose job then no longer
    holds it, so the two are freed as soon as nothing else holds them, not by the cyclic collector)."""

    def tokens(self, job: Job, tokens: list[int]) -> None:
        pass

    def finished(self, job: Job, finish: int, error: str | None) -> None:
        pass


QUIET = QuietSink()

# prefill steps a traced job keeps (an 8k prompt in 64-token steps): its spans are made on the event loop at once
CHUNKS_KEPT = 128


@dataclass(eq=False)
class JobTimes:
    """When a job's phases happened, in nanoseconds since the epoch (0: not yet), stamped by the threads
    that see them: the scheduler (submitted, admitted, first token, finished, each prefill step) and the
    committer (its commits). A few clock reads a job, none a step unless `chunks` is kept (a traced job)."""

    submitted: int = 0
    admitted: int = 0
    first_token: int = 0
    finished: int = 0
    committed: int = 0  # its last commit was durable
    commits: int = 0
    chunks: list[tuple[int, int, int]] | None = None  # (start, end, tokens) of each prefill step it ran in

    def prefilled(self, seconds: float, tokens: int) -> None:
        """A step that just ended, `seconds` long, prefilled `tokens` of this job."""
        if self.chunks is not None and len(self.chunks) < CHUNKS_KEPT:
            end = time.time_ns()
            self.chunks.append((end - int(seconds * 1e9), end, tokens))


@dataclass(eq=False)
class Job:
    """One generation: continue `tokens` by up to `max_tokens` sampled tokens.

    A job with `prefill_only` samples nothing: it fills the cache with its tokens.
    """

    tokens: list[int]
    params: GenParams
    max_tokens: int
    sink: JobSink
    qos: int = QOS_AGENT
    batch_invariant: bool = False
    prefill_only: bool = False
    ignore_eos: bool = False  # end-of-generation tokens are never drawn: the job runs to max_tokens
    grammar: str | None = None  # GBNF every token must follow; the engine holds its state
    grammar_handle: int = 0
    shaping: Shaping | None = None  # bias, penalties, log probabilities; the engine holds its state
    shaping_handle: int = 0
    logprobs: list[LogprobRow] = field(default_factory=list)  # of tokens drawn, until the sink takes them
    cancelled: bool = False
    warm_prefix: int = 0
    generated: int = 0
    admitted: bool = False
    done: bool = False
    queued_at: int = 0  # the step it was queued at, for aging
    submitted: float = 0.0  # monotonic time of its submission, for the time to its first token
    order: int = 0  # first come, first served within a class
    session: int | None = None  # whose generation it is, for the views of the lanes; the scheduler ignores it
    drafter_handle: int = 0  # its prompt lookup in the engine, under --speculate
    spec_proposed: int = 0  # drafted tokens put into its decodes
    spec_accepted: int = 0  # of them, those it would have drawn anyway
    times: JobTimes | None = None  # stamped when its caller logs or traces it

    @property
    def awaits_first_token(self) -> bool:
        """Still in its prefill: nothing generated yet."""
        return self.generated == 0


@dataclass(eq=False)
class Lane:
    """A job running on a slot: `held` is in the KV slot, `feed` goes in next."""

    seq: int
    job: Job
    held: list[int]
    feed: list[int]
    admitted: int  # admission order, newest preempted first
    drawn_at: float = 0.0  # monotonic time of its last token

    @property
    def decoding(self) -> bool:
        return len(self.feed) == 1 and self.job.generated > 0
