"""Continuous batching over one llama.cpp context, with QoS classes and a prefix cache.

Jobs (a prompt of token ids, sampling params, a token budget) wait in one queue per QoS
class and run on lanes; a lane is a KV slot of the context. Each step puts every running
lane into one `llama_decode` batch: one token for a lane that is decoding, a chunk of
prompt for one that is prefilling. A tick is a run of steps (about `tick_ms`, longer while
every lane is busy, cut short when a lane finishes); the sink commits what a tick produced
in one transaction.

- A new lane starts from the longest prefix already cached (a slot, or host memory), so
  forks and continuations are warm. A job that shares a long prefix with a lane still
  prefilling it waits for that lane and copies from it: a burst is prefilled once.
- Classes: 0 interactive, 1 completion, 2 agent, 3 background. The best class goes
  first; a job that waits `starvation_steps` steps rises one class. An interactive or
  completion job that finds every lane busy preempts the lowest-class lane, which keeps
  its KV cached and resumes later from where it stopped, nothing repeated or lost.
  While such a job prefills, no lower-class prefill runs beside it. Each step's prefill
  is sized from the measured cost of a token to last about `STEP_TARGET_S` (`STEP_URGENT_S`
  while interactive or completion work runs and `URGENT_GRACE_S` after; `STEP_BATCH_S` or
  long enough for `BATCH_CHUNK` tokens, and interrupted by such an arrival, on an engine that
  can stop a step), so an arrival never waits long for the step in flight.
- A short job (little prompt left to prefill) never waits behind long work: when every
  lane is busy it runs on one lane beyond `--max-batch` kept for short work, or, when that
  one is taken, on the lane of a job that still has a long prompt ahead of it (in its own
  class or below), preempted like any other (its KV kept). A short prompt is admitted before
  long ones of its class queued ahead of it, and within a step, prefill goes to the shortest
  remaining prompts of the best class first.
- A tick ends as soon as a job has its first token, so it is committed and shown at once.
- A step that only decodes, with nobody waiting for a lane, lets each lane draw a run of tokens
  in one engine call (`pace.RUN_S`, up to a tick), shown as they are drawn; the run ends when any
  of its lanes ends, and an arrival or a cancel cuts it after the decode in flight.
- While a prompt of class agent or background prefills, lanes of those classes that
  already decode run only every `BATCH_DECODE_EVERY`-th short step, and background lanes
  only as often as keeps their wait under `BACKGROUND_WAIT_S` in long ones, so batch work
  gets its first tokens sooner (their tokens come later, in fuller batches).
- `batch_invariant` lanes run alone. `background_divisor` N lets class 2 and 3 lanes
  run only every N-th step.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from ..engine.grammar import GrammarError
from ..engine.interface import Draw, Engine, EngineError, KVFull, Step, StepInterrupted, WorkerGone
from ..engine.shaping import REPEAT_WINDOW, LogprobRow
from ..protocol.schema import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_GRAMMAR,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    QOS_AGENT,
    QOS_BACKGROUND,
    QOS_COMPLETION,
    GenParams,
)
from .job import QUIET, Job, Lane
from .kv_tiers import KVTiers
from .pace import STEP_TARGET_S, Pace
from .park import Park
from .prefix_tree import common_prefix
from .speculate import SpecPolicy, SpecSettings
from .stats import QOS_CLASSES, TIERS, SchedulerStats

log = logging.getLogger("superfluid.scheduler")

STARVATION_STEPS = 64
HOLD_MIN_TOKENS = 128  # a prefix shared with a prefilling lane at least this long is worth waiting for
SHORT_PREFILL = 256  # a job with at most this much prompt left to prefill is short: it never waits for long ones
LONG_PREFILL = 1024  # a lane with more than this left to prefill gives its lane to a short job
BUSY_TICK_S = 0.25  # tick length while every lane is busy
PARK_AFTER_IDLE_S = 2.0  # idle this long, the scheduler parks the idle entries not parked yet
PARK_BUSY_EVERY_S = 5.0  # on a daemon that is never idle, one idle entry is parked this often
# A prompt that needed this much prefill is parked as soon as it is prefilled, not when it is idle, so
# a crash a second later finds it: 256 tokens take about 1 s to prefill on the embedded model on 2 cores,
# their export about 5 ms between two ticks.
WRITE_BEHIND_MIN_TOKENS = 256
BATCH_DECODE_EVERY = 8  # while agents' prompts prefill in short steps, decoding agent lanes run every 8th step
# While batch prompts prefill in long steps, background lanes already decoding wait up to this long for their next
# token. The lanes riding a step decode in a llama.cpp micro-batch of their own, another pass over the weights: on
# the 0.7B bench model (AMD EPYC, 2 cores) a 192-token step took 1.13 s with no lane riding, 1.17-1.25 s with one and
# 1.23-1.28 s with seven, so a rider's token cost 14-110 ms, against 11-12 ms in a decode of eight lanes.
BACKGROUND_WAIT_S = 3.5


class Scheduler:
    """Owns the context's lanes and the prefix cache; runs on its own thread."""

    def __init__(
        self,
        engine: Engine,
        *,
        lanes: int,
        window: int,
        tick_ms: float = 50.0,
        host_cache_bytes: int = 0,
        class_lanes: dict[int, int] | None = None,
        park: Park | None = None,
        speculation: SpecSettings | None = None,
        on_tick: Callable[[], None] = lambda: None,
        now_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.engine = engine
        self.max_lanes = min(lanes, engine.shape.sequences)
        self.class_lanes = dict(class_lanes or {})  # QoS class -> most lanes it may hold (--class-lanes)
        self.window = window
        self.tick_s = tick_ms / 1000.0
        self.on_tick = on_tick
        self.now_ms = now_ms
        self.speculation = SpecPolicy(speculation)
        self.stats = SchedulerStats()
        self.tiers = KVTiers(engine, self.stats, host_cache_bytes=host_cache_bytes, park=park, now_ms=now_ms)
        self.lanes: list[Lane] = []
        self.background_divisor = 1
        self.pace = Pace()
        self._queue: list[Job] = []
        self._prefilled: list[int] = []  # slots whose long prompts were just prefilled, to park (write-behind)
        self._order = itertools.count()
        # interactive and completion jobs submitted, and as many as the last admission saw; while a step of
        # batch work is in flight, such an arrival or a cancel interrupts it (`engine.interrupt`), and while a
        # run of decodes is, any arrival or cancel cuts it after the decode in flight
        self._urgent_arrivals = self._admitted_arrivals = 0
        self._batch_step = self._run_step = False
        self._admissions = itertools.count()
        self._cv = threading.Condition()
        self._stopping = False
        if park is not None:
            park.give_way_to = self.awaits_first_token
        self._worker_gone = False
        self._thread = threading.Thread(target=self._run, name="superfluid-scheduler", daemon=True)

    # ---- called from other threads ----

    def start(self) -> None:
        """Start the thread, once the park's rates are measured: a request sent when the model is loaded never
        waits for the probe (on the 0.7B bench model it took a first request's 0.3-0.5 s)."""
        if self.tiers.park is not None:
            self._calibrate()
        self._thread.start()

    def stop(self, why: str = "the model was unloaded") -> None:
        """Stop the thread; every job still running or waiting ends with finish 5 and `why`."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self.engine.abandon_restart()  # a worker restart waiting out its backoff would outlast the join
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._fail_all(why)
        with self._cv:
            waiting, self._queue = self._queue, []
        for job in waiting:
            self._finish(job, FINISH_ERROR, f"generation failed: {why}")
        self.on_tick()  # what the failed jobs leave is committed
        if self.tiers.park is not None and not self._worker_gone:
            try:
                self.tiers.park_idle()
            except EngineError as e:  # a worker that died meanwhile took its KV along
                log.warning("parking at stop failed: %s", e)
            self.tiers.park.flush()

    def queued(self) -> int:
        """Jobs waiting for a lane."""
        with self._cv:
            return len(self._queue)

    def busy(self) -> bool:
        """Every lane runs a job (as of the last step): a new job would wait."""
        return self.stats.lanes_active >= self.max_lanes

    def submit(self, job: Job) -> None:
        if len(job.tokens) >= self.window:
            raise ValueError(f"prompt of {len(job.tokens)} tokens does not fit the {self.window}-token window")
        with self._cv:
            job.qos = min(max(job.qos, 0), QOS_CLASSES - 1)
            job.queued_at = self.stats.steps
            job.submitted = time.monotonic()
            if job.times is not None:
                job.times.submitted = time.time_ns()
            job.order = next(self._order)
            self._queue.append(job)
            if job.qos <= QOS_COMPLETION:
                self.pace.urgent()
                self._urgent_arrivals += 1
                if self._batch_step and self.engine.interrupt is not None:
                    self.engine.interrupt.set()  # the batch step in flight stops: this job is admitted first
            if self._run_step and self.engine.interrupt is not None:
                self.engine.interrupt.cut()  # the run in flight ends after its decode: this job is admitted next
            self._cv.notify()

    def warm(self, tokens: list[int]) -> None:
        """Prefill `tokens` into the cache in the background (a pinned session after a restart)."""
        if 1 < len(tokens) < self.window:
            greedy = GenParams(0.0, 1.0, 0.0, 0, 0)
            self.submit(Job(list(tokens), greedy, 0, QUIET, qos=QOS_BACKGROUND, prefill_only=True))

    def cancel(self, job: Job) -> None:
        with self._cv:
            job.cancelled = True
            interrupt = self.engine.interrupt
            if interrupt is not None:  # a client that hung up gets its lane back now, not after the step
                if self._batch_step:
                    interrupt.set()
                if self._run_step:
                    interrupt.cut()
            self._cv.notify()

    def kv_tokens(self) -> int:
        """Tokens whose KV the slots hold: the running lanes' and the idle entries' (a snapshot: the lists
        are copied whole, under the GIL, before they are read)."""
        lanes, entries = list(self.lanes), list(self.tiers.cache.entries.values())
        return sum(len(lane.held) for lane in lanes) + sum(len(entry.tokens) for entry in entries)

    def pin(self, tokens: list[int], until_ms: int) -> None:
        with self._cv:
            self.tiers.pin(tokens, until_ms)

    # ---- the scheduler thread ----

    def worker_died(self) -> None:
        """The engine's worker process is gone (called from its watcher): recover at once."""
        with self._cv:
            self._worker_gone = True
            self._cv.notify()

    def _run(self) -> None:
        parked = False  # the idle entries were parked since the last tick
        parked_at = time.monotonic()
        while True:
            chore: Callable[[], None] | None = None
            with self._cv:
                while not self._stopping and not self.lanes and not self._queue and not self._worker_gone:
                    if self.tiers.slot_to_free() is not None:
                        chore = self.tiers.free_a_slot
                        break
                    if self.tiers.park is None or parked:
                        self._cv.wait()
                    elif not self._cv.wait(PARK_AFTER_IDLE_S):
                        chore = self._park_idle
                        break
                if self._stopping:
                    return
            if chore is not None:  # outside the lock: a submit must not wait for an export
                self._idle_chore(chore)
                parked = parked or chore == self._park_idle
                continue
            parked = False
            self.stats.tick_in_flight = True
            try:
                if self._worker_gone:
                    raise WorkerGone("the model's worker stopped")
                self._tick()
            except WorkerGone as e:
                self._recover(str(e))
            except Exception:
                log.exception("scheduler tick failed")
                self._fail_all("scheduler fault")
            self.stats.ticks += 1
            self.stats.tick_in_flight = False
            self.on_tick()
            if self._prefilled:  # after the commit: the first token is shown before the export
                self._idle_chore(self._park_prefilled)
            if self.tiers.park is not None and time.monotonic() - parked_at >= PARK_BUSY_EVERY_S:
                # a daemon that is never idle parks too, a little at a time
                self._idle_chore(lambda: self._park_idle(limit=1))
                parked_at = time.monotonic()

    def awaits_first_token(self) -> bool:
        """True while a job waits for its first token: queued, or prefilling in a lane. Read from other
        threads (the park's writer) without the lock: a glance, which a moment later may be stale."""
        return bool(self._queue) or any(lane.job.awaits_first_token for lane in list(self.lanes))

    def _idle_chore(self, chore: Callable[[], None]) -> None:
        """Housekeeping between ticks: a worker that dies meanwhile is recovered at the next tick."""
        try:
            chore()
        except WorkerGone:
            with self._cv:
                self._worker_gone = True
        except Exception:
            log.exception("housekeeping between ticks failed")

    def _park_prefilled(self) -> None:
        """Park the slots whose long prompts this tick prefilled, write-behind: a running lane's, or the
        idle entry a finished one left."""
        slots, self._prefilled = self._prefilled, []
        running = {lane.seq: lane.held for lane in self.lanes}
        for seq in slots:
            entry = self.tiers.cache.entries.get(seq)
            held = running.get(seq, list(entry.tokens) if entry is not None else None)
            if held is not None:
                self.tiers.park_slot(seq, held)

    def _park_idle(self, limit: int | None = None) -> None:
        """Idle entries to the park, until a job arrives."""
        self.tiers.park_idle(limit, interrupted=lambda: bool(self._queue) and not self._stopping)

    def _calibrate(self) -> None:
        """The park's rates, before the first job."""
        cost = self.tiers.calibrate()
        if cost is not None:
            self.pace.token_cost = cost

    def _recover(self, why: str) -> None:
        """The worker died: every generation it held ends with finish 5, its slots are empty, a new one starts."""
        with self._cv:
            cut = [job for job in self._queue if job.admitted]  # preempted mid-generation: their KV is gone too
            for job in cut:
                self._queue.remove(job)
            for job in [*self._queue, *cut, *(lane.job for lane in self.lanes)]:
                job.grammar_handle = job.shaping_handle = job.drafter_handle = 0  # their state went with the worker
        cut += [lane.job for lane in self.lanes]
        self.lanes.clear()
        self.stats.lanes_active = 0
        for job in cut:
            self._finish(job, FINISH_ERROR, f"generation failed: {why}")
        self.tiers.reset()
        while not self._stopping:
            try:
                self.engine.restart()
                break
            except EngineError as e:
                log.error("a new llama.cpp worker did not start: %s", e)
        if self._stopping:
            return  # unloaded meanwhile: no new worker
        self._worker_gone = False
        self.stats.respawns += 1

    def _tick(self) -> None:
        started = time.monotonic()
        while True:
            self._reap_cancelled()
            if self.engine.interrupt is not None:
                self.engine.interrupt.clear()
            self._admitted_arrivals = self._urgent_arrivals  # admitted now, or waiting for a lane
            self._admit()
            if not self.lanes:
                return
            finished = self._step()
            # with every lane busy nobody waits for a free one: commit less often, decode more
            target = self.tick_s if len(self.lanes) < self.max_lanes else max(self.tick_s, BUSY_TICK_S)
            if finished or time.monotonic() - started >= target:
                return

    def _reap_cancelled(self) -> None:
        for lane in [lane for lane in self.lanes if lane.job.cancelled]:
            self._retire(lane, FINISH_CANCELLED)
        with self._cv:
            cancelled = [job for job in self._queue if job.cancelled]
            for job in cancelled:
                self._queue.remove(job)
        for job in cancelled:
            self._finish(job, FINISH_CANCELLED)

    # ---- admission ----

    def _class_now(self, job: Job) -> int:
        """A job's class after aging: one better for every `STARVATION_STEPS` it waited."""
        return max(0, job.qos - (self.stats.steps - job.queued_at) // STARVATION_STEPS)

    def _admit(self) -> None:
        held: set[int] = set()
        while True:
            with self._cv:
                waiting = [job for job in self._queue if id(job) not in held]
                # a short prompt goes before long ones of its class: while admissions wait on a pending copy,
                # one a step, a chat queued behind eight agents waited for all eight (2.3-4.3 s) and goes first.
                # Its prompt's length stands for what it has to prefill: this runs every step, a cache lookup not
                job = min(
                    waiting, key=lambda j: (self._class_now(j), len(j.tokens) > SHORT_PREFILL, j.order), default=None
                )
            if job is None:
                break
            if self._class_full(job) or self._waits_for_prefix(job):
                held.add(id(job))
                continue
            if len(self.lanes) >= self.max_lanes and not (self._preempt_for(job) or self._room_for_short(job)):
                break
            if any(lane.job.batch_invariant for lane in self.lanes) and job.qos >= self._invariant_class():
                break  # nothing at or below a batch-invariant lane's class joins it
            with self._cv:
                self._queue.remove(job)
            try:
                self.lanes.append(self._seed(job))
            except WorkerGone:
                with self._cv:
                    self._queue.append(job)  # it waits for the next worker
                raise
            except EngineError as e:
                self._finish(job, FINISH_ERROR, f"generation failed: {e}")
            if self.engine.copy_pending:
                break  # the copy runs at the next decode; later admissions may move its slots
        with self._cv:
            depth = [0] * QOS_CLASSES
            for job in self._queue:
                depth[job.qos] += 1
            self.stats.queue_depth = depth
        self.stats.lanes_active = len(self.lanes)

    def _class_full(self, job: Job) -> bool:
        """True when the job's class already holds every lane `--class-lanes` gives it."""
        cap = self.class_lanes.get(job.qos)
        return cap is not None and sum(lane.job.qos == job.qos for lane in self.lanes) >= cap

    def _invariant_class(self) -> int:
        return min(lane.job.qos for lane in self.lanes if lane.job.batch_invariant)

    def _waits_for_prefix(self, job: Job) -> bool:
        """True when a running lane is prefilling a long prefix this job shares: copy it once it is in."""
        if job.qos <= QOS_COMPLETION or job.admitted:
            return False
        tokens = np.asarray(job.tokens, dtype=np.int32)
        for lane in self.lanes:
            if not lane.feed or lane.job.generated:
                continue
            ahead = common_prefix(tokens, np.asarray(lane.held + lane.feed, dtype=np.int32))
            if ahead >= HOLD_MIN_TOKENS and ahead > len(lane.held):
                self.stats.held_for_prefix += 1
                return True
        return False

    def _preempt_for(self, job: Job) -> bool:
        """Free a lane for an interactive or completion job by preempting a lower class."""
        if self._class_now(job) > QOS_COMPLETION:
            return False
        candidates = [lane for lane in self.lanes if lane.job.qos > job.qos and not lane.job.batch_invariant]
        if not candidates:
            return False
        lane = max(candidates, key=lambda lane: (lane.job.qos, lane.decoding, lane.admitted))
        self._preempt(lane)
        return True

    def _room_for_short(self, job: Job) -> bool:
        """A lane for a short job: the one kept beyond --max-batch, else one with a long prompt still to prefill."""
        spare = len(self.lanes) == self.max_lanes and len(self.lanes) < self.engine.shape.sequences
        klass = self._class_now(job)
        candidates = [
            lane
            for lane in self.lanes
            if lane.job.qos >= klass and not lane.job.batch_invariant and len(lane.feed) > LONG_PREFILL
        ]
        if not spare and not candidates:
            return False  # no room either way: spare the prefix lookup, this runs every step while lanes are full
        tokens = np.asarray(job.tokens, dtype=np.int32)
        running = {lane.seq: np.asarray(lane.held, dtype=np.int32) for lane in self.lanes}
        seed = self.tiers.cache.lookup(tokens, running, self.now_ms())
        if len(tokens) - (seed.length if seed else 0) > SHORT_PREFILL:
            return False
        if spare:
            return True
        self._preempt(max(candidates, key=lambda lane: len(lane.feed)))
        return True

    def _preempt(self, lane: Lane) -> None:
        """Stop a lane; its job goes back to the front of its class with the stream so far."""
        job = lane.job
        self.lanes.remove(lane)
        if not job.prefill_only:  # a warm-up never feeds its last token; its tokens stay as they are
            job.tokens = lane.held + lane.feed
        self.tiers.keep(lane.seq, lane.held)
        with self._cv:
            job.order = -next(self._order)  # ahead of everything else in its class
            job.queued_at = self.stats.steps
            self._queue.append(job)
        self.stats.preemptions += 1
        log.debug("preempted a class %d lane on slot %d after %d tokens", job.qos, lane.seq, job.generated)

    def _seed(self, job: Job) -> Lane:
        tokens = np.asarray(job.tokens, dtype=np.int32)
        running = {lane.seq: np.asarray(lane.held, dtype=np.int32) for lane in self.lanes}
        place = self.tiers.place(tokens, running, self.pace.token_cost)
        seq, length = place.seq, place.length
        try:
            self._open_sampling(job)
        except WorkerGone:
            raise
        except EngineError:
            self.tiers.drop(seq)
            raise
        log.debug("admit %d tokens (class %d) on slot %d: %s", len(tokens), job.qos, seq, place.source)
        if not job.admitted:
            job.warm_prefix = length
            self.stats.warm_prefix_tokens += length
            self.stats.cold_admissions += length == 0
            self.stats.tier_hits[TIERS.index(place.tier)] += 1
            job.admitted = True
            if job.times is not None:
                job.times.admitted = time.time_ns()
        feed = list(job.tokens[length:])
        if job.prefill_only:
            feed = feed[:-1]
        return Lane(seq, job, list(job.tokens[:length]), feed, next(self._admissions))

    def _open_sampling(self, job: Job) -> None:
        """The engine's state of a job's grammar, shaping and drafter: opened once, kept while the job is
        preempted."""
        if job.grammar is not None and not job.grammar_handle:
            try:
                job.grammar_handle = self.engine.open_grammar(job.grammar)
            except GrammarError as e:
                raise EngineError(str(e)) from None
        if job.shaping is not None and not job.shaping_handle:
            job.shaping_handle = self.engine.open_shaping(job.shaping, job.tokens[-REPEAT_WINDOW:])
        if not job.drafter_handle and self.speculation.may_draft(job):
            job.drafter_handle = self.engine.open_drafter(job.tokens)

    def _step(self) -> bool:
        """One decode over every lane that runs this step; returns True when the tick should end."""
        finished = self._retire_prefilled()
        if any(lane.job.qos <= QOS_COMPLETION for lane in self.lanes):
            self.pace.urgent()  # steps stay short while it runs
        step_s = self.pace.step_s(self.engine.interrupt is not None)
        batch_step = self.pace.is_batch(step_s)
        plan = self._plan(step_s, batch_step)
        if not plan:
            if not finished:
                time.sleep(0.005)  # throttled by the background rate: nothing runs this step
            self.stats.steps += 1
            return finished
        tokens = np.fromiter((t for _, chunk, _ in plan for t in chunk), dtype=np.int32)
        positions = np.concatenate([np.arange(start, start + len(chunk), dtype=np.int32) for _, chunk, start in plan])
        seqs = np.concatenate([np.full(len(chunk), lane.seq, dtype=np.int32) for lane, chunk, _ in plan])
        want = np.zeros(len(tokens), dtype=np.int8)
        owners: list[tuple[Lane, int]] = []
        draws: list[Draw] = []
        end = 0
        decode_only = all(lane.decoding for lane, _, _ in plan)
        draft = self.speculation.draft_length(len(plan), decode_only)
        run = self._run_length(plan, draft > 0) if decode_only else 1
        for lane, chunk, start in plan:
            end += len(chunk)
            job = lane.job
            if len(chunk) == len(lane.feed) and not job.prefill_only:
                want[end - 1] = 1
                owners.append((lane, len(draws)))
                draws.append(
                    Draw(
                        job.params,
                        start + len(chunk),
                        job.ignore_eos,
                        job.grammar_handle,
                        job.shaping_handle,
                        run,
                        # a run ends where the job would end: its max_tokens, or the window
                        max(1, min(job.max_tokens - job.generated, self.window - start - len(chunk))),
                        job.drafter_handle,
                        draft if job.drafter_handle and lane.decoding else 0,
                        self.speculation.adaptive,
                    )
                )
        step = Step(tokens, positions, seqs, want, draws, probe=bool(draft) and self.speculation.probing(len(plan)))
        shown = [0] * len(draws)  # by draw: its tokens a reader was shown while the step ran
        if run > 1:
            step.on_decode = functools.partial(self._show_drawn, owners, shown)
        while True:
            try:
                started = time.perf_counter()
                drawn = self._engine_step(step, batch_step and not decode_only, run > 1)
                took = time.perf_counter() - started
                if not decode_only:
                    self.pace.prefilled(len(tokens), len(owners), step.first_decode_s)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("step: %d tokens over %d lanes in %.0f ms", len(tokens), len(plan), took * 1000)
                break
            except StepInterrupted:
                self.stats.steps_interrupted += 1
                return True  # nothing of it stands: the tick ends, and the next admits who interrupted it
            except KVFull:
                if self.tiers.evict():
                    continue
                return self._shed(plan)
            except WorkerGone:
                raise
            except EngineError as e:
                for lane, _, _ in plan:
                    self._retire(lane, FINISH_ERROR, f"generation failed: {e}", keep=False)
                return True
        decodes = step.decodes
        total = sum(len(tokens) for tokens in drawn)
        self.stats.steps += decodes
        prefilled = sum(len(chunk) for lane, chunk, _ in plan if not lane.job.generated)
        self.pace.measure(self.stats, prefilled, total, took, decodes if decode_only else 0, draft > 0)
        jobs = {index: lane.job for lane, index in owners}
        drafted = stood = 0
        for index, (proposed, accepted) in step.spec.items():
            self._record_draft(jobs[index], proposed, accepted)
            drafted, stood = drafted + proposed, stood + accepted
        if decode_only:
            self.speculation.record(len(plan), decodes, step.drafted, step.plain, drafted, stood)
        for lane, chunk, _ in plan:
            lane.held.extend(chunk)
            del lane.feed[: len(chunk)]
            if lane.job.generated:
                self.stats.decode_tokens += len(chunk)
            else:
                self.stats.prefill_tokens += len(chunk)
                if lane.job.times is not None:
                    lane.job.times.prefilled(took, len(chunk))
        for lane, index in owners:
            for i, token in enumerate(drawn[index]):
                if i:
                    lane.held.append(lane.feed.pop())  # the token drawn before it, decoded in the same call
                    self.stats.decode_tokens += 1
                logprobs = step.logprobs.get(index) if i == 0 else None
                finished |= self._advance(lane, token, logprobs, shown=i < shown[index])
                if lane.job.done:
                    break
        return finished | self._retire_prefilled()

    def _engine_step(self, step: Step, batch_work: bool, run: bool) -> list[list[int]]:
        """The engine's step. One of `batch_work` stops (StepInterrupted) for an interactive or completion job
        submitted since the last admission, whether it came before the step began or during it; one that is a
        `run` of decodes ends after the decode in flight for any job submitted or cancelled (`Interrupt.cut`)."""
        interrupt = self.engine.interrupt
        if interrupt is None or not (batch_work or run):
            return self.engine.step(step)
        with self._cv:
            self._batch_step, self._run_step = batch_work, run
            if batch_work and self._urgent_arrivals != self._admitted_arrivals:
                interrupt.set()
            if run and self._queue:
                interrupt.cut()
        try:
            return self.engine.step(step)
        finally:
            self._batch_step = self._run_step = False

    def _record_draft(self, job: Job, proposed: int, accepted: int) -> None:
        job.spec_proposed += proposed
        job.spec_accepted += accepted
        self.stats.spec_proposed += proposed
        self.stats.spec_accepted += accepted

    def _run_length(self, plan: list[tuple[Lane, list[int], int]], drafting: bool) -> int:
        """Decodes this decode-only step may make in one engine call: one while someone waits for a lane
        or the background is throttled (they want every step), or where log probabilities come back
        (one row per call)."""
        if self._queue or self.background_divisor > 1:
            return 1
        if any(lane.job.shaping is not None and lane.job.shaping.logprobs >= 0 for lane, _, _ in plan):
            return 1
        return self.pace.run_length(drafting, self.tick_s)

    def _retire_prefilled(self) -> bool:
        done = [lane for lane in self.lanes if lane.job.prefill_only and not lane.feed]
        for lane in done:
            self._retire(lane, FINISH_NONE)
        return bool(done)

    def _plan(self, step_s: float, batch_step: bool) -> list[tuple[Lane, list[int], int]]:
        """Which tokens of which lanes go into this step's batch, its prefill sized to last `step_s` (a step of
        batch work where `batch_step`)."""
        lanes = self.lanes
        invariant = [lane for lane in lanes if lane.job.batch_invariant]
        if invariant:
            lanes = invariant[:1]
        throttled = self.background_divisor > 1 and self.stats.steps % self.background_divisor != 0
        runnable = [lane for lane in lanes if lane.feed and not (throttled and lane.job.qos >= QOS_AGENT)]
        plan = []
        decoding = [lane for lane in runnable if lane.decoding]
        # batch work's first tokens first: while an agent's prompt prefills (a cache warm-up waits for no token),
        # batch lanes already decoding ride only some steps, their tokens coming later in fuller batches.
        # Interactive and completion lanes ride every step
        if any(not lane.decoding and not lane.job.prefill_only and lane.job.qos >= QOS_AGENT for lane in runnable):
            if not batch_step and self.stats.steps % BATCH_DECODE_EVERY:
                decoding = [lane for lane in decoding if lane.job.qos < QOS_AGENT]  # short steps: every few
            elif batch_step:
                # a long step: background lanes ride when they would otherwise wait over BACKGROUND_WAIT_S for
                # their next token (the step after this one ends about 2 * step_s from now)
                late = time.monotonic() + 2 * step_s - BACKGROUND_WAIT_S
                decoding = [lane for lane in decoding if lane.job.qos < QOS_BACKGROUND or lane.drawn_at <= late]
        for lane in decoding:
            plan.append((lane, lane.feed[:1], len(lane.held)))
        inputs = sum(len(chunk) for _, chunk, _ in plan)
        budget = self.pace.prefill_budget(inputs, self.engine.shape.batch, step_s)
        prefilling = sorted(
            (lane for lane in runnable if not lane.decoding), key=lambda lane: (lane.job.qos, len(lane.feed))
        )
        urgent = any(lane.job.qos <= QOS_COMPLETION for lane in prefilling)
        completes = False  # a prompt completes in this step
        for lane in prefilling:
            if urgent and lane.job.qos > QOS_COMPLETION:
                break  # an interactive prompt finishes with no lower-class prefill beside it
            take = min(len(lane.feed), budget)
            if completes and take < len(lane.feed):
                # a first token is due: the next prompt's head shares the step only as far as a short step
                # holds (a long step of eight agents' prompts gave them their first tokens half a step late);
                # whole prompts share all of it, so a burst of short requests prefills together
                take = min(take, self.pace.tokens_in(STEP_TARGET_S) - sum(len(c) for _, c, _ in plan))
            if take <= 0:
                break
            plan.append((lane, lane.feed[:take], len(lane.held)))
            budget -= take
            completes = completes or (take == len(lane.feed) and not lane.job.prefill_only)
        # llama.cpp cuts a batch into micro-batches of consecutive slots, taken in the batch's order: decoding
        # lanes in slot order share one, and prompt chunks go before them, so a chunk never shares the decoding
        # lanes' micro-batch. On the 0.7B bench model, 300-token chunks behind three lanes decoding on the slots
        # before theirs prefilled at 70 tok/s; placed first, at 110-114 (two separate decodes: 108-113)
        return sorted(plan, key=lambda entry: (entry[0].decoding, entry[0].seq))

    def _show_drawn(self, owners: list[tuple[Lane, int]], shown: list[int], drawn: list[list[int]]) -> None:
        """A run's tokens so far, given to their jobs' sinks before the step ends (the end of a turn is not:
        `_advance` takes it), so a reader sees each token as it is drawn; `shown` counts them by draw."""
        end = self.engine.end_of_generation
        for lane, index in owners:
            new = drawn[index][shown[index] :]
            for i, token in enumerate(new):
                if end[token]:
                    new = new[:i]
                    break
            if new:
                lane.job.sink.tokens(lane.job, new)
                shown[index] += len(new)

    def _advance(self, lane: Lane, token: int, logprobs: LogprobRow | None = None, *, shown: bool = False) -> bool:
        """Take the lane's drawn token (its sink has it already where `shown`); returns True when the tick
        should end (its job is over, or began)."""
        job = lane.job
        position = len(lane.held)
        if job.generated == 0 and self.tiers.park is not None and position - job.warm_prefix >= WRITE_BEHIND_MIN_TOKENS:
            self._prefilled.append(lane.seq)
        if self.engine.end_of_generation[token]:
            self._retire(lane, FINISH_STOP if job.grammar is None else FINISH_GRAMMAR)
            return True
        job.generated += 1
        lane.drawn_at = time.monotonic()
        if job.generated == 1:
            self.stats.last_ttft_seconds = lane.drawn_at - job.submitted
            if job.times is not None:
                job.times.first_token = time.time_ns()
        if logprobs is not None:
            job.logprobs.append(logprobs)
        if not shown:
            job.sink.tokens(job, [token])
        if job.generated >= job.max_tokens or position + 1 >= self.window:
            lane.feed = [token]  # sampled, not yet decoded: the slot holds everything before it
            self._retire(lane, FINISH_LENGTH)
            return True
        lane.feed = [token]
        return job.generated == 1  # a first token ends the tick: it is committed and shown at once

    def _shed(self, plan: list[tuple[Lane, list[int], int]]) -> bool:
        """No room for the batch and nothing to evict: fail the lane with the most prompt left."""
        lane = max((lane for lane, _, _ in plan), key=lambda lane: (len(lane.feed), lane.seq))
        self._retire(
            lane,
            FINISH_ERROR,
            f"the KV slot of this generation ({self.engine.shape.window} tokens) is full; "
            "start the daemon with a larger --max-context",
            keep=False,
        )
        return True

    def _retire(self, lane: Lane, finish: int, error: str | None = None, *, keep: bool = True) -> None:
        self.lanes.remove(lane)
        if keep and lane.held:
            self.tiers.keep(lane.seq, lane.held)
        else:
            self.tiers.drop(lane.seq)
        self.stats.lanes_active = len(self.lanes)
        self._finish(lane.job, finish, error)

    def _finish(self, job: Job, finish: int, error: str | None = None) -> None:
        job.done = True
        if job.times is not None:
            job.times.finished = time.time_ns()
        grammar, shaping, drafter = job.grammar_handle, job.shaping_handle, job.drafter_handle
        job.grammar_handle = job.shaping_handle = job.drafter_handle = 0
        try:
            if grammar:
                self.engine.close_grammar(grammar)
            if shaping:
                self.engine.close_shaping(shaping)
            if drafter:
                self.engine.close_drafter(drafter)
        except WorkerGone:
            self._worker_gone = True  # noticed here; recovered after this tick
        except EngineError:
            log.exception("closing a job's grammar, shaping or drafter failed")
        job.sink.finished(job, finish, error)

    def _fail_all(self, why: str) -> None:
        for lane in list(self.lanes):
            self._retire(lane, FINISH_ERROR, f"generation failed: {why}", keep=False)
