"""Logit bias, penalties and log probabilities on rows of logits, and their trip over the worker channel."""

from __future__ import annotations

import numpy as np

from superfluid.api.logprobs import LogprobText
from superfluid.engine import wire
from superfluid.engine.drafting import Arm
from superfluid.engine.interface import Draw, Step
from superfluid.engine.shaping import LogprobRow, Shaper, Shaping, log_softmax_row
from superfluid.protocol.schema import GenParams

NO_EOG = np.zeros(8, dtype=bool)


def row(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def test_bias_bans_at_minus_100_and_adds_otherwise() -> None:
    shaper = Shaper(Shaping(logit_bias=((1, -100.0), (2, 1.5))), [], NO_EOG[:4])
    logits = row(1.0, 9.0, 2.0, 3.0)
    shaper.apply(logits)
    assert logits[1] == -np.inf and logits[2] == 3.5 and logits[0] == 1.0


def test_presence_and_frequency_follow_what_was_drawn() -> None:
    shaper = Shaper(Shaping(presence_penalty=0.5, frequency_penalty=1.0), [3, 3, 3], NO_EOG[:4])
    logits = row(1.0, 1.0, 1.0, 1.0)
    shaper.apply(logits)
    assert list(logits) == [1.0, 1.0, 1.0, 1.0], "the prompt does not count, the reply does"
    for token in (2, 2, 1):
        shaper.accept(token)
    shaper.apply(logits)
    assert list(logits) == [1.0, -0.5, -1.5, 1.0]


def test_repeat_penalty_looks_back_over_prompt_and_reply_but_spares_end_of_turn() -> None:
    eog = np.array([False, False, False, True])
    shaper = Shaper(Shaping(repeat_penalty=2.0), [0] + [2] * 63 + [3], eog)
    logits = row(4.0, 4.0, -4.0, 4.0)
    shaper.apply(logits)
    assert list(logits) == [4.0, 4.0, -8.0, 4.0], "64 tokens back: token 0 is out of the window, 3 ends turns"
    shaper.accept(1)
    logits = row(4.0, 4.0, -4.0, 4.0)
    shaper.apply(logits)
    assert list(logits) == [4.0, 2.0, -8.0, 4.0]


def test_log_softmax_row_lists_the_best_first_and_never_above_zero() -> None:
    logits = row(0.5, 3.0, 3.0, -1.0, 2.0)
    found = log_softmax_row(logits, 2, 3)
    expected = logits - np.log(np.exp(logits.astype(np.float64)).sum())
    assert [t for t, _ in found.top] == [1, 2, 4], "ties go to the lower id"
    assert np.allclose([v for _, v in found.top], expected[[1, 2, 4]], atol=1e-6)
    assert found.logprob == found.top[1][1] and found.logprob <= 0.0
    assert log_softmax_row(row(5.0), 0, 1).logprob == 0.0
    assert log_softmax_row(logits, 0, 0).top == ()


def test_shaping_and_drawn_logprobs_cross_the_channel_whole() -> None:
    draw = Draw(GenParams(0.0, 1.0, 0.0, 0, 0), 1)
    shaping = Shaping(((4, -100.0), (9, 0.25)), 0.5, -0.25, 1.125, 3)
    payload = wire.encode_shaping(shaping, [7, 8, 9])
    assert wire.decode_shaping(memoryview(payload)) == (shaping, [7, 8, 9])
    rows = {1: LogprobRow(5, -0.5, ((5, -0.5), (2, -1.25))), 2: LogprobRow(6, -2.0, ())}
    for drawn, logprobs, spec, decodes, arms in (
        ([[3, 4, 8], [5], [6]], rows, {0: (4, 2)}, 3, (Arm(2, 9, 0.05), Arm(1, 3, 0.0125))),
        ([[3]], {}, {}, 1, (Arm(), Arm())),
        ([[3, 9], [], [1]], {}, {0: (1, 1), 2: (15, 0)}, 2, (Arm(1, 2, 0.5), Arm())),
    ):
        empty = [np.zeros(0)] * 4
        sent = Step(*empty, [draw] * len(drawn), logprobs, spec, decodes=decodes, drafted=arms[0], plain=arms[1])
        got = Step(*empty, [draw] * len(drawn))
        assert wire.decode_drawn(memoryview(wire.encode_drawn(sent, drawn)), got) == drawn
        assert (got.logprobs, got.spec, got.decodes, (got.drafted, got.plain)) == (logprobs, spec, decodes, arms)
    step = Step(
        np.arange(2, dtype=np.int32),
        np.arange(2, dtype=np.int32),
        np.zeros(2, dtype=np.int32),
        np.array([0, 1], dtype=np.int8),
        [Draw(GenParams(0.5, 1.0, 0.0, 40, 9), 77, True, 3, 5, 6, 12, 4, 7, False)],
    )
    step.probe = True
    back = wire.decode_step(memoryview(wire.encode_step(step)))
    assert back.probe, "a step says whether it is a trial of drafting"
    assert back.draws == step.draws, "a draw names its shaping, its run, its limit and its drafter"


def test_logprob_text_joins_to_the_text_and_stops_where_it_was_cut() -> None:
    pieces = [b"Hi", b" th", b"ere", b"\xc3", b"\xa9!", b" end"]
    text = LogprobText(pieces)
    text.add(LogprobRow(t, -0.1, ()) for t in range(len(pieces)))
    released = text.release(len("Hi th"))
    assert [e.drawn.token for e in released] == ["Hi", " th"]
    rest = text.rest(cut=False)
    assert "".join(e.drawn.token for e in released + rest) == "Hi there\u00e9! end"
    assert rest[1].drawn.token == "" and rest[1].drawn.bytes == b"\xc3", "a split character is whole in its last token"
    cut = LogprobText(pieces)
    cut.add(LogprobRow(t, -0.1, ()) for t in range(len(pieces)))
    assert [e.drawn.token for e in cut.release(len("Hi t")) + cut.rest(cut=True)] == ["Hi", " th"]
