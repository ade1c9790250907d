"""Scheduler logic on a fake context that checks every decode against what each slot holds."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from superfluid.engine.llama import ContextShape
from superfluid.protocol.schema import FINISH_LENGTH, GenParams
from superfluid.scheduler.scheduler import Job, Scheduler

VOCAB = 64
GREEDY = GenParams(0.0, 1.0, 0.0, 0, 0)


@dataclass
class FakeModel:
    n_vocab: int = VOCAB
    end_of_generation: np.ndarray = field(default_factory=lambda: np.eye(1, VOCAB, 0, dtype=bool)[0])


class FakeContext:
    """Slots hold token lists; logits are a pure function of the slot's whole content."""

    def __init__(self, sequences: int, window: int = 256, batch: int = 32) -> None:
        self.shape = ContextShape(window, sequences, batch, 1)
        self.model = FakeModel()
        self.slots: dict[int, list[int]] = {s: [] for s in range(sequences)}

    def decode(self, tokens: np.ndarray, positions: np.ndarray, seqs: np.ndarray, want: np.ndarray) -> np.ndarray:
        rows = []
        for token, position, seq, wanted in zip(tokens, positions, seqs, want, strict=True):
            held = self.slots[int(seq)]
            assert position == len(held), f"slot {seq} holds {len(held)} positions, decode wrote at {position}"
            held.append(int(token))
            if wanted:
                logits = np.zeros(VOCAB, dtype=np.float32)
                logits[1 + (sum(held) * 31 + len(held)) % (VOCAB - 1)] = 1.0
                rows.append(logits)
        return np.array(rows)

    def copy(self, source: int, target: int, length: int) -> None:
        self.slots[target] = list(self.slots[source][:length])

    def truncate(self, seq: int, length: int) -> None:
        del self.slots[seq][length:]


class Collect:
    def __init__(self) -> None:
        self.out: list[int] = []
        self.finish: int | None = None
        self.done = threading.Event()

    def tokens(self, job: Job, tokens: list[int]) -> None:
        self.out += tokens

    def finished(self, job: Job, finish: int, error: str | None) -> None:
        self.finish = finish
        self.done.set()


def run(scheduler: Scheduler, prompt: list[int], max_tokens: int = 6) -> tuple[list[int], int]:
    sink = Collect()
    job = Job(prompt, GREEDY, max_tokens, sink=sink)
    scheduler.submit(job)
    assert sink.done.wait(10)
    return sink.out, job.warm_prefix


def test_a_copy_source_is_never_the_slot_evicted_for_its_copy() -> None:
    alone = Scheduler(FakeContext(sequences=4), lanes=1, window=256)
    alone.start()
    expected, _ = run(alone, [5, 6, 7, 9, 9])
    alone.stop()

    scheduler = Scheduler(FakeContext(sequences=2), lanes=1, window=256)
    scheduler.start()
    try:
        run(scheduler, [5, 6, 7, 8, 8])  # leaves slot A holding [5, 6, 7, 8, 8, ...]
        run(scheduler, [20, 21, 22])  # leaves slot B; no slot is free now, and A is the older entry
        out, warm = run(scheduler, [5, 6, 7, 9, 9])  # shares 3 tokens with A: A must not be the one evicted
        assert warm == 3 and out == expected
    finally:
        scheduler.stop()


def test_continuations_take_over_their_entry_and_stay_warm() -> None:
    scheduler = Scheduler(FakeContext(sequences=3), lanes=1, window=256)
    scheduler.start()
    try:
        first, warm = run(scheduler, [1, 2, 3], max_tokens=4)
        assert warm == 0 and len(first) == 4
        stream = [1, 2, 3, *first]
        rest, warm = run(scheduler, stream, max_tokens=4)
        assert warm == len(stream) - 1, "everything but the last sampled token was cached"
        uncut = Scheduler(FakeContext(sequences=3), lanes=1, window=256)
        uncut.start()
        whole, _ = run(uncut, [1, 2, 3], max_tokens=8)
        uncut.stop()
        assert first + rest == whole
    finally:
        scheduler.stop()


def test_the_window_ends_a_generation_with_length() -> None:
    scheduler = Scheduler(FakeContext(sequences=2, window=16), lanes=1, window=16)
    scheduler.start()
    try:
        sink = Collect()
        scheduler.submit(Job(list(range(1, 13)), GREEDY, 100, sink=sink))
        assert sink.done.wait(10)
        assert sink.finish == FINISH_LENGTH and len(sink.out) == 4
    finally:
        scheduler.stop()
