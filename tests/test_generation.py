"""A generation's text ahead of its commit: handed to its listener in order, the first piece at
once and the rest gathered between hand-overs, so a stream does not wake its event loop per
token."""

from __future__ import annotations

import gc
import time
import weakref

import pytest

from superfluid.core import generation
from superfluid.core.bus import Provisional
from superfluid.core.generation import GenerationRun
from superfluid.model.channels import ChannelSplitter
from superfluid.protocol.schema import CHANNEL_TEXT, FINISH_STOP, EventMsg, GenParams
from superfluid.telemetry.access_log import AccessRecord

WORDS = [f"w{i} ".encode() for i in range(40)]


class Recorder:
    def __init__(self) -> None:
        self.items: list[object] = []

    def put(self, item: object) -> None:
        self.items.append(item)

    def texts(self) -> list[str]:
        return [item.text for item in self.items if isinstance(item, Provisional)]


class NoSubscribers:
    def publish(self, session: int, events: list[EventMsg]) -> None: ...

    def provisional(self, session: int, channel: int, text: str) -> None: ...


def streamed(listener: Recorder) -> GenerationRun:
    """A greedy run of up to 40 tokens whose text goes to `listener` ahead of its commit."""
    return GenerationRun(
        1,
        [1, 2, 3],
        GenParams(0.0, 1.0, 0.0, 0, 0),
        40,
        qos=0,
        batch_invariant=False,
        splitter=ChannelSplitter(WORDS),
        listener=listener,
        provisional=True,
        publisher=NoSubscribers(),
    )


INTERVAL = 0.2  # the hand-over interval for the test, long enough that no pause on a busy machine ends it


def test_text_ahead_of_its_commit_goes_out_at_once_then_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(generation, "HAND_OVER_S", INTERVAL)
    listener = Recorder()
    run = streamed(listener)
    run.tokens(run.job, [0])
    assert listener.texts() == ["w0 "], "the first piece is not held"
    for token in range(1, 6):
        run.tokens(run.job, [token])
    assert listener.texts() == ["w0 "] and run.has_output, "pieces within the interval wait"
    time.sleep(INTERVAL)
    run.tokens(run.job, [6])
    assert listener.texts() == ["w0 ", "w1 w2 w3 w4 w5 w6 "], "one hand-over carries what was gathered"
    run.tokens(run.job, [7])
    bodies = run.drain()
    assert listener.texts() == ["w0 ", "w1 w2 w3 w4 w5 w6 ", "w7 "], "a tick's end hands over the rest"
    assert all(item.channel == CHANNEL_TEXT for item in listener.items if isinstance(item, Provisional))
    assert [t for body in bodies for t in body.span] == list(range(8))


def test_a_concluded_run_is_freed_by_reference_counts_with_its_job_and_access_record() -> None:
    # a run's job had the run as its sink, and the access record following it was the run's `on_done`: each finished
    # run, with every event it delivered, waited for the cyclic collector, whose full passes stall every stream
    gc.disable()
    try:
        record = AccessRecord("http", "POST", "/v1/chat/completions")
        run = streamed(Recorder())
        record.attach(run, "smollm2")
        run.tokens(run.job, [0, 1])
        run.finished(run.job, FINISH_STOP, None)
        assert run.drain()
        run.conclude()
        held = [weakref.ref(run), weakref.ref(run.job), weakref.ref(record)]
        del run, record
        assert [ref() is None for ref in held] == [True, True, True], "run, job, record: freed"
    finally:
        gc.enable()
