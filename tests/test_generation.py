"""A generation's text ahead of its commit: handed to its listener in order, once per tick with
what the tick drew, so a stream does not wake its event loop per token."""

from __future__ import annotations

from superfluid.core.bus import Provisional
from superfluid.core.generation import GenerationRun
from superfluid.model.channels import ChannelSplitter
from superfluid.protocol.schema import CHANNEL_TEXT, EventMsg, GenParams

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


def test_text_ahead_of_its_commit_goes_out_once_a_tick() -> None:
    listener = Recorder()
    run = GenerationRun(
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
    run.tokens(run.job, [0])
    assert listener.texts() == [] and run.has_output, "a tick's text waits for its end"
    first = run.drain()
    assert listener.texts() == ["w0 "], "the tick's end hands it over"
    for token in range(1, 6):
        run.tokens(run.job, [token])
    assert listener.texts() == ["w0 "], "pieces within a tick are gathered"
    bodies = first + run.drain()
    assert listener.texts() == ["w0 ", "w1 w2 w3 w4 w5 "], "one hand-over carries the tick's pieces"
    assert not run.has_output
    assert all(item.channel == CHANNEL_TEXT for item in listener.items if isinstance(item, Provisional))
    assert [t for body in bodies for t in body.span] == list(range(6))
