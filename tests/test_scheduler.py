"""Scheduler logic on a fake engine that checks every decode against what each slot holds."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_engine import VOCAB, FakeEngine, next_of

from superfluid.engine.drafting import Arm
from superfluid.engine.sampling import splitmix64
from superfluid.protocol.schema import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, GenParams
from superfluid.scheduler import pace as pace_module
from superfluid.scheduler import scheduler as scheduler_module
from superfluid.scheduler.job import Job
from superfluid.scheduler.park import Park, park_fingerprint
from superfluid.scheduler.scheduler import BATCH_DECODE_EVERY, STARVATION_STEPS, Scheduler
from superfluid.scheduler.speculate import (
    CHANGED,
    HOLD_MAX,
    HOLD_MIN,
    PROBE_MAX,
    SELDOM_HOLD,
    TRIALS,
    WATCH,
    SpecGate,
    SpecProbe,
    SpecSettings,
)

GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)


def _noise(held: list[int]) -> int:
    """A model whose tokens follow their positions only, scrambled: what prompt lookup never drafts well."""
    return 1 + splitmix64(len(held)) % (VOCAB - 1)


def _cycle(held: list[int]) -> int:
    """A model that repeats the stream's token 7 places back: what prompt lookup drafts well."""
    return held[-7] if len(held) >= 7 else 1 + len(held)


class Collect:
    def __init__(self) -> None:
        self.out: list[int] = []
        self.finish: int | None = None
        self.done = threading.Event()

    def tokens(self, job: Job, tokens: list[int]) -> None:
        self.out += tokens

    def finished(self, job: Job, finish: int, error: str | None) -> None:
        self.finish = finish
        self.when = time.monotonic()
        self.done.set()


def run(scheduler: Scheduler, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    sink = Collect()
    job = Job(prompt, GREEDY, max_tokens, sink=sink)
    scheduler.submit(job)
    assert sink.done.wait(10)
    return sink.out, job.warm_prefix


def alone(prompt: list[int], max_tokens: int) -> list[int]:
    """What a prompt generates on a scheduler of its own."""
    scheduler = Scheduler(FakeEngine(sequences=2), lanes=1, window=1024)
    scheduler.start()
    try:
        return run(scheduler, prompt, max_tokens)[0]
    finally:
        scheduler.stop()


def started(
    scheduler: Scheduler, prompt: list[int], max_tokens: int, qos: int = 2, **kw: object
) -> tuple[Job, Collect]:
    sink = Collect()
    job = Job(prompt, GREEDY, max_tokens, sink=sink, qos=qos, **kw)  # type: ignore[arg-type]
    scheduler.submit(job)
    return job, sink


def decoding(scheduler: Scheduler, prompt: list[int], qos: int = 2) -> tuple[Job, int]:
    """A long job started and decoding, and the slot it decodes on."""
    job, sink = started(scheduler, prompt, 3000, qos=qos)
    while len(sink.out) < 3:
        time.sleep(0.001)
    return job, next(lane.seq for lane in scheduler.lanes if lane.job is job)


def test_a_scheduler_with_a_park_measures_its_rates_before_it_takes_a_job(tmp_path: Path) -> None:
    # the probe runs in start(), so a request sent once the model is loaded never waits behind its decodes
    context = FakeEngine(sequences=4, delay=0.01)
    scheduler = Scheduler(context, lanes=2, window=256, park=Park(tmp_path, park_fingerprint("test model", 1), 0))
    scheduler.start()
    try:
        probe = len(context.llama.orders)
        assert probe >= 2 and scheduler.tiers.read_cost > 0, "start() returned with the park's rates measured"
        out, _ = run(scheduler, [5, 6, 7])
        assert out == alone([5, 6, 7], 6), "the probe left nothing behind in the slots"
        assert len(context.llama.orders) - probe <= 6, "the job's decodes came right after the probe's"
    finally:
        scheduler.stop()


def test_the_park_writer_gives_way_from_a_jobs_submission_to_its_first_token(tmp_path: Path) -> None:
    context = FakeEngine(sequences=4, delay=0.05)
    park = Park(tmp_path, park_fingerprint("test model", 1), 0)
    scheduler = Scheduler(context, lanes=2, window=256, park=park)
    scheduler.start()
    try:
        assert park.give_way_to == scheduler.awaits_first_token and not park.give_way_to()
        job, sink = started(scheduler, [5, 6, 7], 3000)
        assert park.give_way_to(), "a job waits for its first token"
        while not sink.out:
            time.sleep(0.001)
        assert not park.give_way_to(), "its first token is out: the writer goes on while it decodes"
        scheduler.cancel(job)
    finally:
        scheduler.stop()


def test_a_copy_source_is_never_the_slot_evicted_for_its_copy() -> None:
    shared = list(range(100, 140))
    alone = Scheduler(FakeEngine(sequences=4), lanes=1, window=256)
    alone.start()
    expected, _ = run(alone, [*shared, 9, 9])
    alone.stop()

    scheduler = Scheduler(FakeEngine(sequences=2), lanes=1, window=256)
    scheduler.start()
    try:
        run(scheduler, [*shared, 8, 8])  # leaves slot A holding the shared part and more
        run(scheduler, [20, 21, 22])  # leaves slot B; no slot is free now, and A is the older entry
        out, warm = run(scheduler, [*shared, 9, 9])  # shares 40 tokens with A: A must not be the one evicted
        assert warm == len(shared) and out == expected
    finally:
        scheduler.stop()


def test_continuations_take_over_their_entry_and_stay_warm() -> None:
    scheduler = Scheduler(FakeEngine(sequences=3), lanes=1, window=256)
    scheduler.start()
    try:
        first, warm = run(scheduler, [1, 2, 3], max_tokens=4)
        assert warm == 0 and len(first) == 4
        stream = [1, 2, 3, *first]
        rest, warm = run(scheduler, stream, max_tokens=4)
        assert warm == len(stream) - 1, "everything but the last sampled token was cached"
        uncut = Scheduler(FakeEngine(sequences=3), lanes=1, window=256)
        uncut.start()
        whole, _ = run(uncut, [1, 2, 3], max_tokens=8)
        uncut.stop()
        assert first + rest == whole
    finally:
        scheduler.stop()


def test_the_window_ends_a_generation_with_length() -> None:
    scheduler = Scheduler(FakeEngine(sequences=2, window=16), lanes=1, window=16)
    scheduler.start()
    try:
        sink = Collect()
        scheduler.submit(Job(list(range(1, 13)), GREEDY, 100, sink=sink))
        assert sink.done.wait(10)
        assert sink.finish == FINISH_LENGTH and len(sink.out) == 4
    finally:
        scheduler.stop()


def test_an_interactive_job_preempts_background_work_which_then_resumes_exactly() -> None:
    context = FakeEngine(sequences=4, delay=0.002)
    scheduler = Scheduler(context, lanes=1, window=1024)
    scheduler.start()
    try:
        background, bg = started(scheduler, [7, 7, 7], 60, qos=3)
        while len(bg.out) < 5:
            time.sleep(0.001)
        _chat, fg = started(scheduler, [9, 9, 9], 4, qos=0)
        assert fg.done.wait(10)
        assert not bg.done.is_set(), "the chat finished first, while the background job waited"
        assert bg.done.wait(10)
        assert bg.out == alone([7, 7, 7], 60), "nothing repeated or lost"
        assert fg.out == alone([9, 9, 9], 4)
        assert scheduler.stats.preemptions == 1 and background.warm_prefix == 0
    finally:
        scheduler.stop()


LONG_PROMPT = [5 + i % 50 for i in range(1000)]


@contextlib.contextmanager
def in_a_long_batch_step() -> Iterator[tuple[Scheduler, Job, Collect]]:
    """A scheduler whose background job, LONG_PROMPT for 8 tokens, is a second into its prefill: at 2 ms a
    position its steps grow to a whole batch of 512 positions, about a second, and it is in its second."""
    engine = FakeEngine(sequences=4, window=1024, position_delay=0.002, interruptible=True)
    scheduler = Scheduler(engine, lanes=2, window=1024)
    scheduler.start()
    try:
        job, sink = started(scheduler, LONG_PROMPT, 8, qos=3)
        time.sleep(1.0)
        yield scheduler, job, sink
    finally:
        scheduler.stop()


def test_an_interactive_arrival_interrupts_a_long_batch_step_which_then_resumes_exactly() -> None:
    with in_a_long_batch_step() as (scheduler, _background, bg):
        sent = time.monotonic()
        _chat, fg = started(scheduler, [9, 9, 9], 4, qos=0)
        while not fg.out:
            time.sleep(0.001)
        waited = time.monotonic() - sent
        assert scheduler.stats.steps_interrupted == 1
        assert waited < 0.3, f"the chat's first token took {waited:.2f} s: it waited for the long step"
        assert fg.done.wait(10) and bg.done.wait(10)
        assert bg.out == alone(LONG_PROMPT, 8), "the interrupted step left nothing behind, and ran again"
        assert fg.out == alone([9, 9, 9], 4)


def test_a_cancel_frees_its_lane_without_waiting_for_the_long_step_in_flight() -> None:
    with in_a_long_batch_step() as (scheduler, job, sink):
        cancelled = time.monotonic()
        scheduler.cancel(job)
        assert sink.done.wait(10)
        assert sink.when - cancelled < 0.3, f"the lane was freed {sink.when - cancelled:.2f} s after the cancel"
        assert scheduler.stats.steps_interrupted == 1


def test_an_interactive_arrival_does_not_interrupt_interactive_work() -> None:
    engine = FakeEngine(sequences=4, window=1024, delay=0.01, interruptible=True)
    scheduler = Scheduler(engine, lanes=2, window=1024)
    scheduler.start()
    try:
        _first, a = started(scheduler, [3, 4, 5], 40, qos=0)
        while len(a.out) < 5:
            time.sleep(0.001)
        _second, b = started(scheduler, [6, 7, 8], 8, qos=0)
        assert a.done.wait(10) and b.done.wait(10)
        assert scheduler.stats.steps_interrupted == 0, "only a step of batch work is ever interrupted"
        assert a.out == alone([3, 4, 5], 40) and b.out == alone([6, 7, 8], 8)
    finally:
        scheduler.stop()


def test_a_burst_sharing_a_prefix_prefills_it_once() -> None:
    context = FakeEngine(sequences=8, delay=0.002, batch=512)
    scheduler = Scheduler(context, lanes=4, window=1024)
    scheduler.start()
    shared = list(range(100, 700))
    try:
        jobs = [started(scheduler, [*shared, 1, 2, q], 3) for q in range(8)]
        for _, sink in jobs:
            assert sink.done.wait(20)
        prefilled = scheduler.stats.prefill_tokens
        assert prefilled < 2 * len(shared), prefilled
        assert all(job.warm_prefix >= len(shared) - 128 for job, _ in jobs[1:])
        for q, (_, sink) in enumerate(jobs):
            assert sink.out == alone([*shared, 1, 2, q], 3)
    finally:
        scheduler.stop()


def test_evicted_prefixes_come_back_from_host_memory() -> None:
    scheduler = Scheduler(FakeEngine(sequences=2), lanes=1, window=1024, host_cache_bytes=1 << 20)
    scheduler.start()
    try:
        document = list(range(200, 300))
        first, _ = run(scheduler, document, 3)
        run(scheduler, [1, 2, 3, 4], 3)
        run(scheduler, [5, 6, 7, 8], 3)  # no free slot: the document's entry goes to host memory
        assert scheduler.stats.exports >= 1
        stream = [*document, *first]
        out, warm = run(scheduler, stream, 4)
        assert scheduler.stats.imports == 1 and warm == len(stream) - 1
        assert out == alone(stream, 4)
    finally:
        scheduler.stop()


def test_pinned_prefixes_are_evicted_last() -> None:
    scheduler = Scheduler(FakeEngine(sequences=2), lanes=1, window=1024)
    scheduler.start()
    try:
        pinned = list(range(200, 240))
        run(scheduler, pinned, 2)
        scheduler.pin(pinned, int(time.time() * 1000) + 60_000)
        run(scheduler, list(range(300, 340)), 2)
        run(scheduler, [31, 32, 33], 2)  # needs a slot: the unpinned, newer entry goes
        _, warm = run(scheduler, [*pinned, 15], 2)
        assert warm == len(pinned)
    finally:
        scheduler.stop()


def test_waiting_work_ages_into_a_better_class() -> None:
    scheduler = Scheduler(FakeEngine(sequences=3, delay=0.0005, window=2048), lanes=1, window=2048)
    scheduler.start()
    try:
        _, running = started(scheduler, [1, 2], STARVATION_STEPS + 40)
        # prompts too long to count as short work, so both wait for the one lane
        _, old = started(scheduler, list(range(300, 700)), 2, qos=3)  # waits the whole run: one class better
        while scheduler.stats.steps < 70:
            time.sleep(0.001)
        _, young = started(scheduler, list(range(800, 1200)), 2, qos=2)  # waits less than STARVATION_STEPS
        assert old.done.wait(10) and young.done.wait(10) and running.done.is_set()
        assert old.when < young.when, "the background job waited long enough to go first"
    finally:
        scheduler.stop()


def test_batch_invariant_lanes_run_alone() -> None:
    context = FakeEngine(sequences=4, delay=0.001)
    scheduler = Scheduler(context, lanes=2, window=1024)
    scheduler.start()
    try:
        _, a = started(scheduler, [1, 2, 3], 20, batch_invariant=True)
        _, b = started(scheduler, [4, 5, 6], 20)
        assert a.done.wait(10) and b.done.wait(10)
        assert all(len(batch) == 1 for batch in context.llama.batches)
    finally:
        scheduler.stop()


def test_the_background_rate_slows_agent_and_background_lanes() -> None:
    context = FakeEngine(sequences=2)
    scheduler = Scheduler(context, lanes=1, window=1024)
    scheduler.background_divisor = 4
    scheduler.start()
    try:
        run(scheduler, [1, 2, 3], 10)
        assert scheduler.stats.steps >= 4 * 9
    finally:
        scheduler.stop()


def test_a_few_shared_tokens_are_prefilled_not_copied() -> None:
    context = FakeEngine(sequences=4)
    scheduler = Scheduler(context, lanes=1, window=256)
    scheduler.start()
    try:
        run(scheduler, [1, 2, 3, 4, 5], 2)
        _, warm = run(scheduler, [1, 2, 3, 9, 9], 2)
        assert warm == 0, "three shared tokens are cheaper to prefill than a whole slot is to copy"
    finally:
        scheduler.stop()


def test_a_short_job_never_waits_behind_busy_lanes_of_its_own_class() -> None:
    context = FakeEngine(sequences=6, delay=0.002, batch=64, window=4096)
    scheduler = Scheduler(context, lanes=2, window=4096)
    scheduler.start()
    try:
        decoding = [started(scheduler, [5, 6, q], 200) for q in range(2)]
        while any(len(sink.out) < 5 for _, sink in decoding):
            time.sleep(0.001)
        _short, quick = started(scheduler, [8, 8, 8], 3)  # both lanes busy: it runs on the lane kept for short work
        assert quick.done.wait(10)
        assert not any(sink.done.is_set() for _, sink in decoding), "the short job did not wait for a lane"
        long_prompts = [started(scheduler, list(range(1000 + q, 2500 + q)), 2) for q in range(2)]
        while not any(context.llama.slots[lane.seq] for lane in scheduler.lanes if lane.job is long_prompts[0][0]):
            time.sleep(0.001)
        _other, other = started(scheduler, [9, 9, 9], 3)
        assert other.done.wait(10)
        assert not any(sink.done.is_set() for _, sink in long_prompts), "it took a lane from a long prefill"
        for _, sink in [*decoding, *long_prompts]:
            assert sink.done.wait(30)
        assert other.out == alone([9, 9, 9], 3)
    finally:
        scheduler.stop()


def test_a_batch_step_lasts_long_enough_for_a_full_chunk_within_its_bounds() -> None:
    pace = pace_module.Pace()
    cheap, dear = 0.5 * pace_module.STEP_BATCH_S, 2 * pace_module.STEP_BATCH_MAX_S
    for cost, expected in (
        (cheap / pace_module.BATCH_CHUNK, pace_module.STEP_BATCH_S),
        (0.0075, pace_module.BATCH_CHUNK * 0.0075),
        (dear / pace_module.BATCH_CHUNK, pace_module.STEP_BATCH_MAX_S),
    ):
        pace.token_cost = cost
        assert pace.step_s(interruptible=True) == pytest.approx(expected)
        assert pace.step_s(interruptible=False) == pace_module.STEP_TARGET_S
        # however long, it is a batch step (interrupted by an interactive arrival); the others are not
        assert pace.is_batch(pace.step_s(interruptible=True))
        assert not pace.is_batch(pace.step_s(interruptible=False))
    pace.urgent()
    assert pace.step_s(interruptible=True) == pace_module.STEP_URGENT_S
    assert not pace.is_batch(pace.step_s(interruptible=True))


def test_a_short_prompt_is_admitted_before_long_ones_queued_ahead_of_it_in_its_class() -> None:
    context = FakeEngine(sequences=1, delay=0.002, batch=64, window=4096)
    scheduler = Scheduler(context, lanes=1, window=4096)
    scheduler.start()
    try:
        _running, sink = started(scheduler, [5, 6, 7], 40)
        while len(sink.out) < 3:
            time.sleep(0.001)
        # the one lane is busy decoding: both wait for it, the long prompt queued first
        _long, long = started(scheduler, list(range(1000, 1600)), 2)
        _short, short = started(scheduler, [8, 8, 8], 3)
        assert short.done.wait(10) and long.done.wait(10)
        assert short.when < long.when, "the short prompt waited for the long one queued before it"
        assert short.out == alone([8, 8, 8], 3)
    finally:
        scheduler.stop()


def prefill_decodes(scheduler: Scheduler, context: FakeEngine, prompt: list[int], qos: int) -> list[int]:
    """Start a job of `prompt` and wait for its first token: the indexes (into `context.llama.orders`) of the
    decodes that carried its prompt."""
    since = len(context.llama.orders)
    job, out = started(scheduler, prompt, 2, qos=qos)
    while not out.out:
        time.sleep(0.001)
    seq = next(lane.seq for lane in scheduler.lanes if lane.job is job)
    return [i for i in range(since, len(context.llama.orders)) if seq in context.llama.orders[i]]


def test_agents_decode_every_few_steps_while_an_agent_prompt_prefills() -> None:
    context = FakeEngine(sequences=6, delay=0.001, batch=64, window=4096)
    scheduler = Scheduler(context, lanes=3, window=4096)
    scheduler.start()
    try:
        agent, agent_seq = decoding(scheduler, [5, 6, 7])
        chat, chat_seq = decoding(scheduler, [8, 9], qos=0)
        prefilling = [context.llama.batches[i] for i in prefill_decodes(scheduler, context, list(range(100, 1300)), 2)]
        assert len(prefilling) >= 16, "the prompt took several steps to prefill"
        assert all(chat_seq in batch for batch in prefilling), "an interactive lane decodes every step"
        agent_steps = sum(agent_seq in batch for batch in prefilling)
        assert 0 < agent_steps <= len(prefilling) // BATCH_DECODE_EVERY + 1, (agent_steps, len(prefilling))
        scheduler.cancel(agent)
        scheduler.cancel(chat)
    finally:
        scheduler.stop()


def test_background_lanes_ride_long_steps_only_as_often_as_their_wait_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    # long steps of 0.2 s (500 positions at 0.4 ms), and a background lane's next token due within 0.7 s
    monkeypatch.setattr(pace_module, "STEP_BATCH_S", 0.2)
    monkeypatch.setattr(scheduler_module, "BACKGROUND_WAIT_S", 0.7)
    context = FakeEngine(sequences=6, window=8192, batch=512, position_delay=0.0004, interruptible=True)
    scheduler = Scheduler(context, lanes=4, window=8192)
    scheduler.start()
    try:
        agent, agent_seq = decoding(scheduler, [5, 6, 7])
        background, background_seq = decoding(scheduler, [8, 9], qos=3)
        steps = prefill_decodes(scheduler, context, list(range(100, 3100)), 3)
        assert len(steps) >= 5, "the prompt took several long steps"
        assert all(agent_seq in context.llama.orders[i] for i in steps), "an agent lane rides every long step"
        rode = [i for i in steps if background_seq in context.llama.orders[i]]
        assert 0 < len(rode) < len(steps), (len(rode), len(steps))
        waits = np.diff([context.llama.ended[i] for i in [steps[0] - 1, *rode]])
        assert max(waits) < 2 * 0.7, f"a background lane waited {max(waits):.2f} s for its next token"
        scheduler.cancel(agent)
        scheduler.cancel(background)
    finally:
        scheduler.stop()


def test_prompt_chunks_lead_a_batch_and_decoding_lanes_follow_in_slot_order() -> None:
    # llama.cpp splits a batch into micro-batches of consecutive slots: a chunk behind lanes decoding on the slots
    # before its own shared one with them and prefilled at 0.6 of its speed alone (scheduler._plan)
    context = FakeEngine(sequences=4, delay=0.001, batch=64, window=4096)
    scheduler = Scheduler(context, lanes=4, window=4096)
    scheduler.start()
    try:
        lanes = sorted((decoding(scheduler, [5, 6, q], qos=0) for q in range(4)), key=lambda lane: lane[1])
        scheduler.cancel(lanes[-1][0])  # the last slot frees, and the prompt's lane takes it
        while len(scheduler.lanes) > 3:
            time.sleep(0.001)
        since = len(context.llama.orders)
        _long, long_out = started(scheduler, list(range(100, 1300)), 2, qos=0)
        assert long_out.done.wait(30)
        mixed = [order for order in context.llama.orders[since:] if len(order) > len(set(order)) > 1]
        assert len(mixed) >= 8, "the prompt prefilled beside the decoding lanes"
        assert all(max(order) == lanes[-1][1] for order in mixed), "the prompt's slot is after the decoding lanes'"
        for order in mixed:
            chunk = [seq for seq in order if order.count(seq) > 1]
            singles = order[len(chunk) :]
            assert order[: len(chunk)] == chunk and singles == sorted(singles), order
        for job, _ in lanes[:-1]:
            scheduler.cancel(job)
    finally:
        scheduler.stop()


def test_a_cache_warm_up_does_not_slow_decoding_agents() -> None:
    context = FakeEngine(sequences=4, delay=0.001, batch=64, window=4096)
    scheduler = Scheduler(context, lanes=2, window=4096)
    scheduler.start()
    try:
        agent, agent_seq = decoding(scheduler, [5, 6, 7])
        since = len(context.llama.batches)
        _warm, warmed = started(scheduler, list(range(100, 1300)), 0, prefill_only=True)
        assert warmed.done.wait(30)
        warming = [batch for batch in context.llama.batches[since:] if batch - {agent_seq}]
        assert len(warming) >= 16, "the warm-up took several steps"
        assert all(agent_seq in batch for batch in warming), "a warm-up waits for no first token"
        scheduler.cancel(agent)
    finally:
        scheduler.stop()


def test_a_lone_decoding_lane_draws_runs_of_tokens_per_call_and_stops_where_it_must(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    prompt = list(range(1, 20))
    context = FakeEngine(sequences=2, delay=0.002)
    scheduler = Scheduler(context, lanes=1, window=1024)
    scheduler.start()
    try:
        out = run(scheduler, prompt, max_tokens=61)[0]
    finally:
        scheduler.stop()
    assert len(out) == 61, "a run never draws past max_tokens"
    assert context.calls < 61 / 2, f"{context.calls} engine calls for 61 tokens"
    monkeypatch.setattr(pace_module, "MAX_RUN", 1)
    assert alone(prompt, 61) == out, "a run draws what one call per token draws"
    monkeypatch.setattr(pace_module, "MAX_RUN", 8)
    window = Scheduler(FakeEngine(sequences=2, window=64), lanes=1, window=64)
    window.start()
    try:
        sink = Collect()
        window.submit(Job(prompt, GREEDY, 1000, sink=sink))
        assert sink.done.wait(10)
        assert sink.finish == FINISH_LENGTH and len(prompt) + len(sink.out) == 64, "nor past the window"
    finally:
        window.stop()


def test_a_run_in_flight_ends_after_its_decode_for_an_arrival_or_a_cancel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pace_module, "RUN_S", 10.0)  # runs of a hundred decodes, 5 ms each
    monkeypatch.setattr(pace_module, "MAX_RUN", 100)
    context = FakeEngine(sequences=4, delay=0.005, interruptible=True)
    scheduler = Scheduler(context, lanes=2, window=4096, tick_ms=10_000)
    scheduler.start()
    try:
        running, runs_sink = started(scheduler, [5, 6, 7], 3000)
        while len(runs_sink.out) < 3:
            time.sleep(0.001)
        seq = next(lane.seq for lane in scheduler.lanes if lane.job is running)
        time.sleep(0.05)  # into a run
        calls, since = context.calls, len(context.llama.orders)
        _, arrivals_sink = started(scheduler, [8, 9, 10], 4)
        assert arrivals_sink.done.wait(10) and len(arrivals_sink.out) == 4
        assert context.calls > calls, "the run in flight ended"
        waited = next(i for i, order in enumerate(context.llama.orders[since:]) if set(order) != {seq})
        assert waited <= 2, f"the arrival was prefilled after {waited} decodes of the run in flight"
        time.sleep(0.05)
        since = len(context.llama.orders)
        scheduler.cancel(running)
        assert runs_sink.done.wait(10) and runs_sink.finish == FINISH_CANCELLED
        assert len(context.llama.orders) - since <= 2, "a cancel ends the run in flight after its decode"
    finally:
        scheduler.stop()


class Timed(Collect):
    """A sink that notes when each token reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def tokens(self, job: Job, tokens: list[int]) -> None:
        super().tokens(job, tokens)
        self.times += [time.monotonic()] * len(tokens)


def test_a_runs_tokens_reach_the_sink_as_they_are_drawn_and_the_turns_end_never_does() -> None:
    ends, goes_on = list(range(1, 20)), list(range(50, 60))
    ends_at = len(ends) + 45  # the model ends the first prompt's turn mid-run there, beside a lane that runs on
    context = FakeEngine(
        sequences=4, delay=0.002, model=lambda held: 0 if held[0] == 1 and len(held) == ends_at else next_of(held)
    )
    scheduler = Scheduler(context, lanes=2, window=1024)
    scheduler.start()
    try:
        lone = Timed()
        scheduler.submit(Job(goes_on, GREEDY, 60, sink=lone))
        assert lone.done.wait(10)
        decodes = context.llama.ended[:]
        calls = context.calls
        ending, beside = Timed(), Timed()
        scheduler.submit(Job(ends, GREEDY, 100, sink=ending))
        scheduler.submit(Job(goes_on, GREEDY, 100, sink=beside))
        assert ending.done.wait(10) and beside.done.wait(10)
    finally:
        scheduler.stop()
    assert calls < len(lone.out) / 2, f"{calls} engine calls for {len(lone.out)} tokens: runs formed"
    # one lane, no drafts: token i comes from decode i (the prompt's is decode 0), and is shown before the next ends
    late = [i for i in range(len(lone.out) - 1) if lone.times[i] >= decodes[i + 1]]
    assert not late, f"tokens {late} reached the sink only after the decode that followed theirs"
    assert ending.finish == FINISH_STOP and 0 not in ending.out and len(ending.out) == 45, (ending.finish, ending.out)
    assert beside.out[:60] == lone.out and len(beside.out) == 100


def speculating(
    mode: str, model: object, *, exact: bool = True, delay: float = 0.0, position_delay: float = 0.0
) -> Scheduler:
    settings = SpecSettings(mode, draft_tokens=4, adaptive=True, min_speedup=1.08, exact=exact)
    context = FakeEngine(sequences=4, window=512, delay=delay, model=model, position_delay=position_delay)
    return Scheduler(context, lanes=2, window=512, speculation=settings)


def generate_on(scheduler: Scheduler, prompts: list[list[int]], max_tokens: int, **kw: object) -> list[list[int]]:
    scheduler.start()
    try:
        runs = [started(scheduler, prompt, max_tokens, **kw) for prompt in prompts]
        for _, sink in runs:
            assert sink.done.wait(30)
        return [sink.out for _, sink in runs]
    finally:
        scheduler.stop()


def test_drafts_verified_in_the_decode_give_the_tokens_of_plain_decoding() -> None:
    prompts = [[3, 9, 4, 7, 1, 5, 2, 3, 9, 4], [8, 6, 2, 5, 11, 13, 8, 6]]
    for model in (_cycle, next_of, _noise):
        plain = generate_on(
            Scheduler(FakeEngine(sequences=4, window=512, model=model), lanes=2, window=512), prompts, 60
        )
        # a decode's fixed cost well above what a drafted position adds, as on a machine where drafts pay
        drafting = speculating("prompt-lookup", model, delay=0.002, position_delay=0.0001)
        spoken = generate_on(drafting, prompts, 60)
        assert spoken == plain, model
        assert all(len(out) == 60 for out in spoken)
        stats = drafting.stats
        if model is _cycle:
            assert stats.spec_accepted > 0.8 * stats.spec_proposed > 0, "a repeating stream is drafted and taken"
            # a run drafts before each of its decodes, not once a call: five tokens a decode at best
            assert stats.steps < 60 / 2, f"{stats.steps} decodes for 60 tokens: accepted drafts save decodes"


def test_a_batch_invariant_lane_drafts_only_on_exact_kernels() -> None:
    prompts = [[3, 9, 4, 7, 1, 5, 2, 3, 9, 4]]
    fast = speculating("prompt-lookup", _cycle, exact=False)
    generate_on(fast, prompts, 30, batch_invariant=True)
    assert fast.stats.spec_proposed == 0, "its verified tokens would come from a batch its uncut run never had"
    exact = speculating("prompt-lookup", _cycle, exact=True)
    generate_on(exact, prompts, 30, batch_invariant=True)
    assert exact.stats.spec_proposed > 0


def probe_with(gate: SpecProbe, drafted: Arm, plain: Arm) -> None:
    """Steps of a probe, each with a trial's two arms as given, until it decides."""
    while gate.probing:
        gate.record(drafted.decodes + plain.decodes, drafted, plain)


def test_the_gate_keeps_drafts_only_where_they_pay() -> None:
    gate = SpecProbe(1.08)
    assert gate.phase == "probe" and gate.allows(), "a probe's steps carry drafts: the engine leaves some plain"
    gate.record(4, Arm(3, 12, 0.03), Arm(1, 1, 0.01))
    assert gate.phase == "probe", f"it waits for {TRIALS} plain decodes"
    probe_with(gate, Arm(3, 12, 0.03), Arm(1, 1, 0.01))  # 400 tok/s with drafts, 100 without
    assert gate.phase == "hold" and gate.allows() and gate.speedup == pytest.approx(4.0)
    assert gate.hold == HOLD_MIN, "a first decision holds briefly"
    for _ in range(HOLD_MIN // 4):
        gate.record(4, Arm(), Arm())
    assert gate.phase == "probe", "it measures again after a while"
    probe_with(gate, Arm(3, 4, 0.035), Arm(1, 1, 0.01))  # 114 tok/s against 100: 1.14x
    assert gate.allows() and gate.hold == 2 * HOLD_MIN, "a decision that stands holds longer each time"
    gate.record(2 * HOLD_MIN, Arm(), Arm())
    probe_with(gate, Arm(3, 3, 0.0315), Arm(1, 1, 0.01))  # drafts that stand seldom only slow the decode
    assert gate.phase == "hold" and not gate.allows() and gate.hold == HOLD_MIN, "one that flips, briefly"
    for _ in range(10):
        gate.record(gate.hold, Arm(), Arm())
        probe_with(gate, Arm(3, 3, 0.0315), Arm(1, 1, 0.01))
    assert gate.hold == HOLD_MAX, "up to the longest hold"


def test_a_hold_whose_drafts_stand_less_often_probes_again_at_once() -> None:
    gate = SpecProbe(1.08)
    for _ in range(4):  # rewriting files: drafts stand nine times in ten, and pay each time they are probed
        while gate.probing:
            gate.record(4, Arm(3, 12, 0.03), Arm(1, 1, 0.01), proposed=30, accepted=27)
        gate.record(gate.hold, Arm(), Arm())
    while gate.probing:
        gate.record(4, Arm(3, 12, 0.03), Arm(1, 1, 0.01), proposed=30, accepted=27)
    assert gate.hold == 16 * HOLD_MIN and gate.acceptance == pytest.approx(0.9)
    gate.record(1, Arm(), Arm(), proposed=WATCH, accepted=int(0.9 * WATCH))  # the same text: it holds
    assert gate.phase == "hold"
    gate.record(1, Arm(), Arm(), proposed=WATCH // 2, accepted=0)
    assert gate.phase == "hold", f"it judges {WATCH} drafted tokens at a time"
    gate.record(1, Arm(), Arm(), proposed=WATCH // 2, accepted=int(CHANGED * 0.9 * WATCH) - 1)  # a chat begins
    assert gate.phase == "probe", "a long hold earned rewriting files says nothing about the chat that follows"
    probe_with(gate, Arm(3, 4, 0.035), Arm(1, 1, 0.01))  # drafts still pay, a little
    assert gate.drafting and gate.hold == HOLD_MIN, "the new decision holds briefly"


def test_a_probe_where_drafts_are_seldom_planned_stops_drafting() -> None:
    gate = SpecProbe(1.08)
    for _ in range(PROBE_MAX // 8 - 1):  # eight decodes a step, drafts planned in one of them
        gate.record(8, Arm(1, 3, 0.01), Arm())
    assert gate.phase == "probe"
    gate.record(8, Arm(), Arm(1, 1, 0.01))
    assert gate.phase == "hold" and not gate.allows(), "too few trials to gain from"
    assert gate.hold == SELDOM_HOLD, "and a probe soon would tell little"


def _stutter(held: list[int]) -> int:
    """A model that repeats the stream's token 7 places back, but for one token in four, at random: drafts
    stand in part."""
    mixed = splitmix64(len(held))
    return 1 + mixed % (VOCAB - 1) if mixed % 4 == 0 else _cycle(held)


@pytest.mark.parametrize("truncate_delay", [0.0, 0.02])
def test_auto_keeps_drafts_only_where_they_pay(truncate_delay: float) -> None:
    prompts = [[3, 9, 4, 7, 1, 5, 2, 3, 9, 4]]
    # a decode's fixed cost well above a drafted position's, as on a machine where drafts pay; a cut
    # draft's truncation costing more than the engine's plan knows (it weighs decodes only) makes
    # them lose, and only the trials show it
    scheduler = speculating("auto", _stutter, delay=0.002, position_delay=0.0001)
    scheduler.engine.llama.truncate_delay = truncate_delay  # type: ignore[attr-defined]
    out = generate_on(scheduler, prompts, 600)
    plain = Scheduler(FakeEngine(sequences=4, window=512, model=_stutter), lanes=2, window=512)
    assert out == generate_on(plain, prompts, 600)
    gate = scheduler.speculation.gate
    assert gate is not None
    probe = gate.probe(1)
    assert probe.decisions, "it probed"
    if truncate_delay:
        assert probe.speedup < 1.0 and not probe.drafting, "drafts lost, and stopped"
    else:
        assert probe.speedup > 1.08 and probe.drafting, "drafts paid, and went on"


def test_the_gate_decides_for_each_batch_size_apart() -> None:
    gate = SpecGate(1.08)
    for lanes, drafted in ((1, Arm(3, 12, 0.03)), (8, Arm(3, 24, 0.3))):  # drafts pay for one stream, cost for eight
        while gate.probing(lanes):
            gate.record(lanes, 4, drafted, Arm(1, 8 if lanes == 8 else 1, 0.01 * lanes))
    assert gate.allows(1) and not gate.allows(8) and not gate.allows(9)
    assert gate.probing(4), "4 to 7 lanes have not been measured: they probe"
