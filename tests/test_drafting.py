"""The engine's drafting pieces: prompt lookup over a lane's stream, the odds a drafted token stands,
what a decode costs by its size, and the draft lengths planned from them."""

from __future__ import annotations

import pytest

from superfluid.engine.drafting import Acceptance, Candidate, DecodeTimes, Match, PromptLookup, plan


def test_prompt_lookup_drafts_what_followed_the_last_earlier_occurrence() -> None:
    lookup = PromptLookup([1, 2, 3, 4, 5, 1, 2, 3])
    match = lookup.match()
    assert match == Match(3, 3), "after the trigram 1 2 3, which agrees that far back"
    assert lookup.draft(match, 4) == [4, 5, 1, 2]
    bigram = PromptLookup([7, 8, 9, 4, 8, 9])
    found = bigram.match()
    assert found == Match(3, 2), "after the bigram 8 9"
    assert bigram.draft(found, 5) == [4, 8, 9] and bigram.available(found) == 3, "running into the end"
    assert PromptLookup([1, 2, 3, 4, 5]).match() is None, "nothing to follow"
    latest = PromptLookup([1, 2, 3, 7, 1, 2, 3, 8, 0, 1, 2, 3])
    assert latest.draft(latest.match(), 1) == [8], "the latest occurrence wins"  # type: ignore[arg-type]


def test_agreement_counts_how_far_back_the_source_matches() -> None:
    passage = [10, 11, 12, 13, 14, 15, 16]
    lookup = PromptLookup([*passage, 99, *passage[:5]])
    assert lookup.match() == Match(5, 5), "five tokens of the passage agree before the draft"


def test_the_occurrence_that_agrees_longest_is_the_source() -> None:
    copied = [10, 11, 1, 2, 3, 4]
    lookup = PromptLookup([*copied, 20, 21, 1, 2, 3, 5, 99, *copied[:5]])
    match = lookup.match()
    assert match == Match(5, 5), "the passage being copied, not the later occurrence of 1 2 3"
    assert lookup.draft(match, 1) == [4]  # type: ignore[arg-type]


def test_the_index_follows_the_stream_as_it_is_fed() -> None:
    lookup = PromptLookup([5, 6, 7, 8])
    lookup.feed(4, 9)
    assert lookup.match() is None
    for position, token in ((5, 5), (6, 6), (7, 7)):
        lookup.feed(position, token)
    assert lookup.draft(lookup.match(), 2) == [8, 9], "the index grows with the stream"  # type: ignore[arg-type]
    lookup.feed(7, 7)
    assert lookup.stream == [5, 6, 7, 8, 9, 5, 6, 7], "the same input again changes nothing"
    lookup.feed(2, 1)
    assert lookup.stream == [5, 6, 1] and lookup.match() is None, "an input at an earlier position rewrites the rest"
    lookup.feed(3, 5)
    lookup.feed(4, 6)
    assert lookup.draft(lookup.match(), 3) == [1, 5, 6], "the index was rebuilt for what the stream is now"  # type: ignore[arg-type]


def test_a_drafter_that_missed_positions_drafts_no_more() -> None:
    lookup = PromptLookup([1, 2, 3, 1, 2])
    assert lookup.match() is not None
    lookup.feed(7, 3)
    assert lookup.lost and lookup.match() is None


def test_acceptance_learns_the_odds_by_agreement() -> None:
    acceptance = Acceptance()
    assert acceptance.odds(3) == pytest.approx(Acceptance.PRIOR), "untried: the optimistic prior"
    for _ in range(200):
        acceptance.record(3, 4, 0)  # a fresh match of three: the first drafted token fails
        acceptance.record(12, 4, 4)  # deep in a passage: every drafted token stands
    assert acceptance.odds(3) < 0.05
    assert acceptance.odds(12) > 0.95 and acceptance.odds(15) > 0.95
    assert acceptance.odds(4) == pytest.approx(Acceptance.PRIOR), "past a failure, nothing was tried"
    gains = acceptance.gains(12, 4)
    assert gains[0] == 0.0 and gains[4] == pytest.approx(4.0, abs=0.2)
    assert acceptance.gains(3, 4)[4] < 0.05


# what a decode cost by its positions, in units of a one-position decode: the shape seen on a CPU
CPU = {1: 1.0, 2: 1.83, 3: 2.16, 4: 2.5, 5: 3.07, 6: 3.43, 7: 3.81, 8: 3.67, 12: 4.87, 16: 5.97}


def measured(costs: dict[int, float], lanes: int = 1) -> DecodeTimes:
    times = DecodeTimes(64)
    for positions, seconds in costs.items():
        times.add(lanes, positions, seconds)
    return times


def test_decode_times_interpolate_and_guess_optimistically() -> None:
    times = DecodeTimes(64)
    assert times.cost(1, 1) is None, "nothing measured"
    times.add(1, 1, 1.0)
    assert times.cost(1, 1) == 1.0
    assert times.cost(1, 2) == pytest.approx(1.0 + DecodeTimes.GUESS), "above: a quarter a position"
    assert times.cost(1, 3) is None, "but no further than twice the largest size measured"
    times.add(1, 9, 3.0)
    assert times.cost(1, 5) == pytest.approx(2.0), "between: on the line"
    assert times.cost(1, 18) == pytest.approx(3.0 * (1 + DecodeTimes.GUESS)) and times.cost(1, 19) is None
    times.add(1, 2, 1.9)
    assert times.cost(1, 2) == 1.9, "a size measured is its own: a CPU's second position costs most of a first"
    times.add(1, 1, 2.0)
    assert times.cost(1, 1) == pytest.approx(1.0 + DecodeTimes.WEIGHT), "later decodes move it"
    assert times.cost(8, 9) is None, "eight lanes read eight KVs: their decodes are measured apart"
    times.add(8, 8, 4.0)
    assert times.cost(8, 9) == pytest.approx(4.0 * (1 + DecodeTimes.GUESS / 8))
    assert times.cost(8, 17) is None


def trained(agreed: int, odds_stand: bool) -> Acceptance:
    acceptance = Acceptance()
    for _ in range(300):
        acceptance.record(agreed, 15, 15 if odds_stand else 0)
    return acceptance


def choice(acceptance: Acceptance, agreed: int, longest: int, adaptive: bool = True) -> Candidate:
    return Candidate(acceptance.gains(agreed, longest), adaptive)


def test_plan_drafts_long_where_drafts_stand_and_nothing_where_they_fail() -> None:
    times = measured(CPU)
    stand, fail = trained(8, True), trained(8, False)
    assert plan([choice(stand, 8, 15)], 1, 1, 500, times) == [15], "every token stands: as long as it may"
    assert plan([choice(fail, 8, 15)], 1, 1, 500, times) == [0], "none stands: no draft"
    assert plan([choice(stand, 8, 15)], 1, 1, 3, times) == [3], "no longer than the batch has room for"
    assert plan([choice(fail, 8, 6, adaptive=False)], 1, 1, 500, times) == [6], "not adaptive: always the longest"
    assert plan([choice(stand, 8, 15)], 1, 1, 500, DecodeTimes(64)) == [0], "nothing measured: this decode measures"


def test_plan_weighs_a_draft_against_what_its_positions_cost() -> None:
    acceptance = Acceptance()
    for i in range(300):
        acceptance.record(3, 1, int(i % 5 != 0))  # a first drafted token stands four times in five
        acceptance.record(4, 2, 0)  # a second one never
    one = choice(acceptance, 3, 4)
    assert plan([one], 1, 1, 500, measured(CPU)) == [0], "0.8 more tokens do not pay 0.83 more time"
    cheap = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4}
    assert plan([one], 1, 1, 500, measured(cheap)) == [1], "on cheap positions they do"


def test_plan_gives_the_batch_room_to_the_lanes_most_likely_to_gain() -> None:
    acceptance = trained(8, True)
    for _ in range(300):
        acceptance.record(2, 15, 0)
    times = measured({n: 1.0 + 0.05 * (n - 1) for n in range(2, 65)}, lanes=2)
    unsure, sure = choice(acceptance, 2, 15), choice(acceptance, 8, 15)
    assert plan([unsure, sure], 2, 2, 10, times) == [0, 10]


def test_one_lane_drafts_in_a_decode_of_several() -> None:
    acceptance = trained(8, True)
    times = measured({n: 1.0 + 0.01 * (n - 4) for n in range(4, 65)}, lanes=4)
    lanes = [choice(acceptance, 8, 6), choice(acceptance, 8, 15), choice(acceptance, 8, 6)]
    # every lane's drafts would pay, but each run of drafting lanes costs llama.cpp a pass of its own
    assert plan(lanes, 4, 4, 100, times) == [0, 15, 0]


def test_a_lane_starts_from_the_engines_odds_and_moves_to_its_own() -> None:
    engine = trained(8, True)
    lane = Acceptance(engine)
    assert lane.odds(8) == pytest.approx(engine.odds(8)), "a new lane drafts as lanes did before it"
    for _ in range(20):
        lane.record(8, 15, 0)  # this lane's text does not repeat itself
    assert lane.odds(8) < 0.2, "its own record soon outweighs the engine's"
    assert engine.odds(8) < trained(8, True).odds(8), "and the engine learns from it too"


def test_a_lane_whose_drafts_fare_worse_than_the_engines_odds_trusts_them_less_everywhere() -> None:
    engine = Acceptance()
    for agreed in range(2, 20):  # rewriting files: a drafted token stands nine times in ten
        for i in range(30):
            engine.record(agreed, 1, int(i % 10 != 0))
    story = Acceptance(engine)
    for i in range(12):  # a story that repeats its prompt's words: long agreements, most drafts fail
        story.record(10 + i % 3, 1, int(i % 3 == 0))
    assert story.scale < 0.6
    assert story.odds(16) < 0.6 * engine.odds(16), "at an agreement it never drafted at, too"
    rewrite = Acceptance(engine)
    for _ in range(12):
        rewrite.record(10, 1, 1)
    assert rewrite.odds(16) == pytest.approx(engine.odds(16), rel=0.15), "a lane that fares as well drafts as before"


def test_one_slow_decode_is_bounded_by_the_larger_sizes_measured() -> None:
    times = DecodeTimes(64)
    times.add(1, 1, 1.0)
    times.add(1, 9, 90.0)  # one decode slowed by something else on the machine
    assert times.cost(1, 9) == 90.0
    times.add(1, 17, 5.0)
    assert times.cost(1, 9) == 5.0, "a decode of more positions costs no less"
    assert times.cost(1, 5) == pytest.approx(3.0), "and the sizes around it are guessed from it"


def test_an_old_measurement_is_trusted_less() -> None:
    times = DecodeTimes(64)
    times.add(1, 1, 1.0)
    times.add(1, 2, 3.0)  # a second position dearer than drafts can pay for
    for _ in range(DecodeTimes.FRESH - 1):
        times.add(1, 1, 1.0)
    assert times.cost(1, 2) == pytest.approx(3.0), "fresh: it stands, and no draft of that size is tried"
    for _ in range(3 * DecodeTimes.FRESH):
        times.add(1, 1, 1.0)
    assert times.cost(1, 2) == pytest.approx(1 + 2 * DecodeTimes.FADE**3), "each period shrinks its excess"
    times.add(1, 2, 3.0)
    assert times.cost(1, 2) == pytest.approx(3.0), "tried again, it is known again"


def test_a_larger_decode_moves_with_the_plain_one_when_the_machine_drifts() -> None:
    times = DecodeTimes(64)
    times.add(1, 1, 1.0)
    times.add(1, 5, 2.0)
    for _ in range(50):
        times.add(1, 1, 2.0)  # the machine slows down: only plain decodes happen meanwhile
    assert times.cost(1, 1) == pytest.approx(2.0, rel=1e-3)
    assert times.cost(1, 5) == pytest.approx(4.0, rel=1e-3), "a five-position decode still costs two plain ones"


def test_a_drafted_decode_before_any_plain_one_is_not_taken_for_a_plain_one() -> None:
    times = DecodeTimes(64)
    times.add(1, 5, 3.0)  # a lane that does not adapt drafts from its first decode
    assert times.cost(1, 1) is None, "nothing to measure it against"
    times.add(1, 1, 1.0)
    assert times.cost(1, 1) == 1.0
