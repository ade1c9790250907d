"""Continuous batching over one llama.cpp context.

Jobs (a prompt of token ids, sampling params, a token budget) wait in one queue per QoS
class and run on lanes; a lane is a sequence id of the shared KV pool. Each step puts
every running lane into one `llama_decode` batch: one token for a lane that is
decoding, a chunk of prompt for one that is prefilling. A new lane is seeded from the
longest prefix the pool already holds (`PrefixCache`), so forks and continuations start
warm. A tick is a run of steps (about `tick_ms` long, cut short when a lane finishes or
new work arrives); the sink commits what a tick produced in one transaction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..engine.grammar import Grammar
from ..engine.llama import EngineError, KVFull, LlamaContext
from ..engine.sampling import sample
from ..protocol.schema import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_GRAMMAR,
    FINISH_LENGTH,
    FINISH_STOP,
    QOS_AGENT,
    GenParams,
)
from .prefix_cache import PrefixCache, Seed

log = logging.getLogger("superfluid.scheduler")

QOS_CLASSES = 4


class JobSink(Protocol):
    """Receives a job's output on the scheduler thread."""

    def tokens(self, job: Job, tokens: list[int]) -> None: ...

    def finished(self, job: Job, finish: int, error: str | None) -> None: ...


@dataclass(eq=False)
class Job:
    """One generation: continue `tokens` by up to `max_tokens` sampled tokens."""

    tokens: list[int]
    params: GenParams
    max_tokens: int
    sink: JobSink
    qos: int = QOS_AGENT
    batch_invariant: bool = False
    grammar: Grammar | None = None
    cancelled: bool = False
    warm_prefix: int = 0
    generated: int = 0
    done: bool = False


@dataclass(eq=False)
class Lane:
    """A job running on a sequence id: `held` is in the KV pool, `feed` goes in next."""

    seq: int
    job: Job
    held: list[int]
    feed: list[int]

    @property
    def decoding(self) -> bool:
        return len(self.feed) == 1 and self.job.generated > 0


@dataclass
class SchedulerStats:
    """Counters the metrics endpoint reads."""

    ticks: int = 0
    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    warm_prefix_tokens: int = 0
    cold_admissions: int = 0
    preemptions: int = 0
    evictions: int = 0
    queue_depth: list[int] = field(default_factory=lambda: [0] * QOS_CLASSES)
    lanes_active: int = 0


class Scheduler:
    """Owns the context's lanes and the prefix cache; runs on its own thread."""

    def __init__(
        self,
        context: LlamaContext,
        *,
        lanes: int,
        window: int,
        tick_ms: float = 50.0,
        prefill_chunk: int = 512,
        on_tick: Callable[[], None] = lambda: None,
        now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.context = context
        self.max_lanes = lanes
        self.window = window
        self.tick_s = tick_ms / 1000.0
        self.prefill_chunk = min(prefill_chunk, context.shape.batch)
        self.on_tick = on_tick
        self.now_ms = now_ms
        self.cache = PrefixCache()
        self.stats = SchedulerStats()
        self.lanes: list[Lane] = []
        self.background_divisor = 1
        self._queues: list[deque[Job]] = [deque() for _ in range(QOS_CLASSES)]
        self._free_seqs = list(range(context.shape.sequences - 1, -1, -1))
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="superfluid-scheduler", daemon=True)

    # ---- called from other threads ----

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        if len(job.tokens) >= self.window:
            raise ValueError(f"prompt of {len(job.tokens)} tokens does not fit the {self.window}-token window")
        with self._cv:
            self._queues[min(max(job.qos, 0), QOS_CLASSES - 1)].append(job)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        with self._cv:
            job.cancelled = True
            self._cv.notify()

    # ---- the scheduler thread ----

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self.lanes and not any(self._queues):
                    self._cv.wait()
                if self._stopping:
                    return
            try:
                self._tick()
            except Exception:
                log.exception("scheduler tick failed")
                self._fail_all("scheduler fault")
            self.stats.ticks += 1
            self.on_tick()

    def _tick(self) -> None:
        started = time.monotonic()
        while True:
            self._reap_cancelled()
            self._admit()
            if not self.lanes:
                return
            finished = self._step()
            if finished or time.monotonic() - started >= self.tick_s:
                return

    def _reap_cancelled(self) -> None:
        for lane in [lane for lane in self.lanes if lane.job.cancelled]:
            self._retire(lane, FINISH_CANCELLED)
        with self._cv:
            for queue in self._queues:
                for job in [j for j in queue if j.cancelled]:
                    queue.remove(job)
                    self._finish(job, FINISH_CANCELLED)

    def _next_job(self) -> Job | None:
        with self._cv:
            for queue in self._queues:
                if queue:
                    return queue.popleft()
        return None

    def _admit(self) -> None:
        while len(self.lanes) < self.max_lanes:
            job = self._next_job()
            if job is None:
                break
            try:
                self.lanes.append(self._seed(job))
            except EngineError as e:
                self._finish(job, FINISH_ERROR, f"generation failed: {e}")
        with self._cv:
            self.stats.queue_depth = [len(q) for q in self._queues]
        self.stats.lanes_active = len(self.lanes)

    def _seed(self, job: Job) -> Lane:
        tokens = np.asarray(job.tokens, dtype=np.int32)
        running = {lane.seq: np.asarray(lane.held, dtype=np.int32) for lane in self.lanes}
        seed = self.cache.lookup(tokens, running, self.now_ms())
        if (
            seed is not None
            and not seed.take
            and not self._free_seqs
            and self.cache.victim(self.now_ms(), spare=seed.seq) is None
        ):
            # the entry to copy from is the only one left to evict: take it over instead
            seed = Seed(seed.seq, seed.length, take=seed.seq in self.cache.entries)
        if seed is not None and seed.take:
            seq = seed.seq
            self.cache.remove(seq)
            self.context.truncate(seq, seed.length)
        else:
            seq = self._free_seq(spare=seed.seq if seed is not None else None)
            if seed is not None:
                self.context.copy(seed.seq, seq, seed.length)
                self.cache.touch(seed.seq)
        length = seed.length if seed is not None else 0
        log.debug(
            "admit %d tokens on slot %d: %s",
            len(job.tokens),
            seq,
            "cold" if seed is None else f"{length} warm from slot {seed.seq} ({'taken' if seed.take else 'copied'})",
        )
        job.warm_prefix = length
        self.stats.warm_prefix_tokens += length
        if length == 0:
            self.stats.cold_admissions += 1
        return Lane(seq, job, list(job.tokens[:length]), list(job.tokens[length:]))

    def _free_seq(self, spare: int | None = None) -> int:
        """A slot for a new lane, evicting an idle entry if need be (never `spare`)."""
        if not self._free_seqs and not self._evict(spare):
            raise EngineError("every sequence slot is in use")
        return self._free_seqs.pop()

    def _evict(self, spare: int | None = None) -> bool:
        """Drop the least valuable idle entry other than `spare`; False when there is none."""
        victim = self.cache.victim(self.now_ms(), spare=spare)
        if victim is None:
            return False
        self.cache.remove(victim)
        self.context.truncate(victim, 0)
        self._free_seqs.append(victim)
        self.stats.evictions += 1
        return True

    def _step(self) -> bool:
        """One decode over every lane; returns True when a lane finished."""
        plan = self._plan()
        tokens = np.fromiter((t for _, chunk, _ in plan for t in chunk), dtype=np.int32)
        positions = np.concatenate([np.arange(start, start + len(chunk), dtype=np.int32) for _, chunk, start in plan])
        seqs = np.concatenate([np.full(len(chunk), lane.seq, dtype=np.int32) for lane, chunk, _ in plan])
        want = np.zeros(len(tokens), dtype=np.int8)
        owners = []
        end = 0
        for lane, chunk, _ in plan:
            end += len(chunk)
            if len(chunk) == len(lane.feed):
                want[end - 1] = 1
                owners.append(lane)
        while True:
            try:
                logits = self.context.decode(tokens, positions, seqs, want)
                break
            except KVFull:
                if self._evict():
                    continue
                return self._shed(plan)
            except EngineError as e:
                for lane, _, _ in plan:
                    self._retire(lane, FINISH_ERROR, f"generation failed: {e}", keep=False)
                return True
        self.stats.steps += 1
        for lane, chunk, _ in plan:
            lane.held.extend(chunk)
            del lane.feed[: len(chunk)]
            if lane.job.generated:
                self.stats.decode_tokens += len(chunk)
            else:
                self.stats.prefill_tokens += len(chunk)
        finished = False
        for row, lane in enumerate(owners):
            finished |= self._advance(lane, logits[row])
        return finished

    def _plan(self) -> list[tuple[Lane, list[int], int]]:
        """Which tokens of which lanes go into this step's batch."""
        budget = self.context.shape.batch
        plan = []
        decoding = [lane for lane in self.lanes if lane.decoding]
        prefilling = sorted((lane for lane in self.lanes if not lane.decoding), key=lambda lane: len(lane.feed))
        for lane in decoding:
            plan.append((lane, lane.feed[:1], len(lane.held)))
            budget -= 1
        chunk = self.prefill_chunk if not decoding else max(self.prefill_chunk // 4, 32)
        for lane in prefilling:
            take = min(len(lane.feed), chunk, budget)
            if take <= 0:
                break
            plan.append((lane, lane.feed[:take], len(lane.held)))
            budget -= take
        return plan

    def _advance(self, lane: Lane, logits: np.ndarray) -> bool:
        """Sample the lane's next token; returns True when its job is over."""
        job = lane.job
        position = len(lane.held)
        grammar = job.grammar
        if grammar is None:
            token = sample(logits, job.params, position)
        elif job.params.temperature <= 0 and grammar.allows(token := int(np.argmax(logits))):
            pass  # greedy: the best token is allowed, no need to mask the whole vocabulary
        else:
            token = sample(grammar.mask(logits), job.params, position)
        if self.context.model.end_of_generation[token]:
            self._retire(lane, FINISH_STOP if grammar is None else FINISH_GRAMMAR)
            return True
        if grammar is not None:
            grammar.accept(token)
        job.generated += 1
        job.sink.tokens(job, [token])
        if job.generated >= job.max_tokens or position + 1 >= self.window:
            self._retire(lane, FINISH_LENGTH)
            return True
        lane.feed = [token]
        return False

    def _shed(self, plan: list[tuple[Lane, list[int], int]]) -> bool:
        """The pool is full of live lanes: fail the one with the most prompt left."""
        lane = max((lane for lane, _, _ in plan), key=lambda lane: (len(lane.feed), lane.seq))
        self._retire(
            lane,
            FINISH_ERROR,
            f"the KV slot of this generation ({self.context.shape.window} tokens) is full; "
            "start the daemon with a larger --max-context",
            keep=False,
        )
        return True

    def _retire(self, lane: Lane, finish: int, error: str | None = None, *, keep: bool = True) -> None:
        self.lanes.remove(lane)
        if keep and lane.held:
            self.cache.add(lane.seq, np.asarray(lane.held, dtype=np.int32))
        else:
            self.context.truncate(lane.seq, 0)
            self._free_seqs.append(lane.seq)
        self.stats.lanes_active = len(self.lanes)
        self._finish(lane.job, finish, error)

    def _finish(self, job: Job, finish: int, error: str | None = None) -> None:
        job.done = True
        if job.grammar is not None:
            job.grammar.close()
        job.sink.finished(job, finish, error)

    def _fail_all(self, why: str) -> None:
        for lane in list(self.lanes):
            self._retire(lane, FINISH_ERROR, f"generation failed: {why}", keep=False)
