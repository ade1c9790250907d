"""Speculative decoding where the decodes run: prompt lookup drafts, and how long a draft pays.

A lane that drafts has a `PromptLookup`: its stream (every token it has put on the model's
input, by position) and an index of the stream's n-grams, so the tokens that followed the
latest earlier occurrence of its last few tokens are one dict lookup away. The engine drafts
before every decode of a run, not once per call, so a lane copying a long passage drafts
again as soon as a draft stands.

How long a draft should be depends on two things the engine measures as it goes:
- `Acceptance`: the odds that a drafted token stands, by how many tokens before it already
  agreed with the text it is copied from. A lane deep in a verbatim passage tends to stay in
  it; one that has just found a match again often leaves it at once.
- `DecodeTimes`: what a decode costs by the positions in its batch. On a CPU this is far from
  a straight line: a second position can cost most of a first one, later ones much less.

`plan` picks every drafting lane's length so that the batch's expected tokens per second are
highest, and no draft where none pays.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

log = logging.getLogger("superfluid.engine")

NGRAMS = (3, 2)  # a single token repeats too often to predict what follows it
PLAIN_EVERY = 4  # in a probe, one decode in this many where drafts are planned goes without them
AGREEMENT_CAP = 32  # agreement lengths told apart; longer ones count as this
CANDIDATES = 16  # the latest occurrences of an n-gram weighed as a draft's source


@dataclass(frozen=True)
class Match:
    """Where a draft would come from: the stream position its continuation starts at, and how many
    tokens before that position equal the stream's last ones (at least the n-gram looked up)."""

    at: int
    agreed: int


class PromptLookup:
    """One lane's stream and the index of its n-grams: a draft is what followed an earlier occurrence of
    the stream's last three (else two) tokens. Of the recent occurrences, the one whose tokens before
    agree longest with the stream's is taken (the latest of equals): while a lane copies a passage,
    its source stays the passage, not the latest place a common n-gram such as ` = a[` appeared."""

    def __init__(self, stream: Sequence[int]) -> None:
        self.stream = list(stream)
        self._at: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions that followed its occurrences
        self._indexed = 0  # the n-grams that end before this position are in the index
        self.lost = False  # a position was skipped: the stream no longer matches the lane's

    def feed(self, position: int, token: int) -> None:
        """The lane's input at `position` is `token` (whatever followed it before is dropped)."""
        stream = self.stream
        if position > len(stream):
            if not self.lost:
                log.warning("a drafter missed positions %d to %d; it drafts no more", len(stream), position - 1)
            self.lost = True
            return
        if position < len(stream):
            if stream[position] == token and position == len(stream) - 1:
                return
            del stream[position:]
            if self._indexed > position:  # the index may name positions that are gone
                self._at.clear()
                self._indexed = 0
        stream.append(token)

    def match(self) -> Match | None:
        """Where the stream's end occurred before, if it did."""
        if self.lost:
            return None
        stream, index = self.stream, self._at
        end = len(stream)
        for e in range(self._indexed, end):  # stream[e - n : e] was followed by stream[e]
            for n in NGRAMS:
                if e >= n:
                    index.setdefault(tuple(stream[e - n : e]), []).append(e)
        self._indexed = max(self._indexed, end)
        for n in NGRAMS:
            if end <= n:
                continue
            found = index.get(tuple(stream[end - n :]))
            if not found:
                continue
            best = Match(found[-1], n)
            for at in reversed(found[-CANDIDATES:]):
                agreed = n
                while agreed < min(AGREEMENT_CAP, at) and stream[at - agreed - 1] == stream[end - agreed - 1]:
                    agreed += 1
                if agreed > best.agreed:
                    best = Match(at, agreed)
                    if agreed == AGREEMENT_CAP:
                        break
            return best
        return None

    def draft(self, match: Match, length: int) -> list[int]:
        """Up to `length` tokens of the continuation (fewer where the stream ends)."""
        return self.stream[match.at : match.at + length]

    def available(self, match: Match) -> int:
        return len(self.stream) - match.at


class Acceptance:
    """The odds that a drafted token stands, by its agreement: the tokens before it, in the draft and
    the stream, that equal its source's. Counts decay, so the odds follow the lanes' work.

    The engine keeps one for all its lanes, and each lane one of its own that starts from it (`shared`):
    a lane's odds are its own counts plus `WEIGHT` observations' worth of the engine's, so a new lane
    drafts as lanes did before it, and one whose text repeats itself less soon drafts as its own record
    says. What agreement means depends on the text, though: a story that repeats "the old lighthouse
    keeper" agrees as long as a rewritten file does, and is no more likely to go on as before. So a lane
    also scales the engine's odds by how its drafted tokens fared against them, over all its drafts (a
    lane drafts at any one agreement too seldom to learn it alone)."""

    PRIOR = 0.8  # optimistic: an agreement never tried is tried, then known
    DECAY = 0.99
    WEIGHT = 4.0
    CALIBRATION = 4.0  # drafted tokens' worth of trust in the engine's odds a new lane starts with

    def __init__(self, shared: Acceptance | None = None) -> None:
        self.shared = shared
        start = 0.0 if shared is not None else 1.0
        self._stood = np.full(AGREEMENT_CAP + 1, self.PRIOR * start)
        self._tried = np.full(AGREEMENT_CAP + 1, start)
        self._standing = self._expected = self.CALIBRATION  # the lane's tokens that stood, and the engine's odds of it

    @property
    def scale(self) -> float:
        """How much more (or less) often the lane's drafted tokens stand than the engine's odds said."""
        return self._standing / self._expected

    def odds(self, agreed: int) -> float:
        at = min(agreed, AGREEMENT_CAP)
        if self.shared is None:
            return float(self._stood[at] / self._tried[at])
        engine = min(1.0, self.shared.odds(at) * self.scale)
        return float((self._stood[at] + self.WEIGHT * engine) / (self._tried[at] + self.WEIGHT))

    def record(self, agreed: int, drafted: int, stood: int) -> None:
        """A draft of `drafted` tokens after a match of `agreed`, whose first `stood` tokens stood."""
        for k in range(min(stood + 1, drafted)):  # the tokens after the first that failed were not tried
            at = min(agreed + k, AGREEMENT_CAP)
            self._stood[at] = self._stood[at] * self.DECAY + (k < stood)
            self._tried[at] = self._tried[at] * self.DECAY + 1
            if self.shared is not None:
                self._standing = self._standing * self.DECAY + (k < stood)
                self._expected = self._expected * self.DECAY + self.shared.odds(at)
        if self.shared is not None:
            self.shared.record(agreed, drafted, stood)

    def gains(self, agreed: int, longest: int) -> list[float]:
        """The tokens a draft of each length 0..longest is expected to add: the odds that its first k
        tokens all stand, summed over k."""
        standing, total, out = 1.0, 0.0, [0.0]
        for k in range(longest):
            standing *= self.odds(agreed + k)
            total += standing
            out.append(total)
        return out


@dataclass
class Arm:
    """Decodes of one arm of a trial (`--speculate auto`'s probe): how many, the tokens they drew, their
    seconds (drafting, decoding and drawing included)."""

    decodes: int = 0
    tokens: int = 0
    seconds: float = 0.0

    def add(self, other: Arm) -> None:
        self.decodes += other.decodes
        self.tokens += other.tokens
        self.seconds += other.seconds

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Drafter:
    """One lane's drafting: the lookup over its stream, and its own odds (which start from the engine's)."""

    lookup: PromptLookup
    acceptance: Acceptance


class DecodeTimes:
    """Seconds a decode takes by its lanes (sequences) and the positions in its batch, as measured (recent
    decodes weigh most). The lanes count apart because each reads its own KV: eight lanes of one position
    cost more than one lane of eight.

    A plain decode (a position a lane) is measured most often; a larger one is kept as its ratio to the
    plain decode of as many lanes at the time, so when the machine slows down or speeds up (other work,
    another tenant) every size moves with the plain one, and a draft is never judged against a plain
    decode measured in other weather.

    What a size costs is known from the sizes measured: its own measurement, on the line between the
    measured sizes around it, or optimistically above the largest (each further position a quarter of
    the per-position cost below it), but no further than twice its size: where a decode is already
    compute-bound (several lanes on a CPU) every position costs about what a lane's own does, and a
    draft as long as an optimistic guess allows would cost several decodes to find that out, while
    one of twice the size reaches the long drafts that pay where short ones do not in a few tries. A
    decode of more positions never costs less than one of fewer, so one slow decode of some size is
    bounded by the larger sizes measured. A measurement is trusted less as it ages: for every `FRESH`
    decodes of as many lanes since, its excess over the plain decode shrinks by `FADE`, so a size that
    did not pay is tried again now and then (the lanes' contexts grow, the machine changes), not every
    few decodes."""

    WEIGHT = 0.2  # of a new measurement
    GUESS = 0.25
    FRESH = 256
    FADE = 0.8

    def __init__(self, largest: int) -> None:
        self._largest = largest
        self._plain: dict[int, float] = {}  # by lanes: seconds
        self._ratios: dict[int, np.ndarray] = {}  # by lanes, by positions: to the plain decode's seconds
        self._measured: dict[int, np.ndarray] = {}  # by lanes, by positions: the decode count at its last measure
        self._decodes: dict[int, int] = {}
        self._rows: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # by lanes: `_row`'s answer, and when

    def add(self, lanes: int, positions: int, seconds: float) -> None:
        if positions > self._largest:
            return
        if lanes not in self._ratios:
            self._ratios[lanes] = np.ones(self._largest + 1)
            self._measured[lanes] = np.full(self._largest + 1, -1)
            self._decodes[lanes] = 0
        count = self._decodes[lanes] = self._decodes[lanes] + 1
        plain = self._plain.get(lanes)
        if positions <= lanes:
            self._plain[lanes] = seconds if plain is None else (1 - self.WEIGHT) * plain + self.WEIGHT * seconds
            return
        if plain is None:
            return  # no plain decode of as many lanes to measure it against yet
        ratios, measured = self._ratios[lanes], self._measured[lanes]
        ratio = seconds / plain
        if measured[positions] >= 0 and count - measured[positions] <= self.FRESH:
            ratio = (1 - self.WEIGHT) * ratios[positions] + self.WEIGHT * ratio
        ratios[positions] = ratio
        measured[positions] = count

    def cost(self, lanes: int, positions: int) -> float | None:
        """The expected seconds of a decode of `positions` over `lanes`; None before any decode of as many
        lanes was measured, or where the size is beyond what is guessed."""
        plain = self._plain.get(lanes)
        if plain is None:
            return None
        ratio = self._ratio(lanes, min(positions, self._largest))
        return None if ratio is None else plain * ratio

    def _ratio(self, lanes: int, positions: int) -> float | None:
        if positions <= lanes:
            return 1.0
        sizes, ratios = self._row(lanes)
        i = int(np.searchsorted(sizes, positions))  # sizes[0] is the plain decode's, below `positions`
        if i < len(sizes) and sizes[i] == positions:
            return float(ratios[i])
        lo = int(sizes[i - 1])
        if i < len(sizes):
            hi = int(sizes[i])
            return float(ratios[i - 1] + (ratios[i] - ratios[i - 1]) * (positions - lo) / (hi - lo))
        if positions > 2 * lo:
            return None
        return float(ratios[i - 1] * (1 + self.GUESS * (positions - lo) / lo))

    def _row(self, lanes: int) -> tuple[np.ndarray, np.ndarray]:
        """The sizes measured for `lanes` (the plain decode's first) and their ratios as trusted now: aged, and
        never above a larger size's. Worked out once a decode."""
        count = self._decodes[lanes]
        cached = self._rows.get(lanes)
        if cached is not None and cached[0] == count:
            return cached[1], cached[2]
        measured = self._measured[lanes]
        sizes = np.concatenate(([lanes], np.flatnonzero(measured >= 0)))
        ages = (count - measured[sizes[1:]]) // self.FRESH
        ratios = np.concatenate(([1.0], 1 + (self._ratios[lanes][sizes[1:]] - 1) * self.FADE**ages))
        ratios = np.minimum.accumulate(ratios[::-1])[::-1]
        self._rows[lanes] = (count, sizes, ratios)
        return sizes, ratios


@dataclass(frozen=True)
class Candidate:
    """A lane that may draft this decode: the tokens a draft of each length 0..longest is expected to add
    (`Acceptance.gains`), and whether its length adapts."""

    gains: Sequence[float]
    adaptive: bool

    @property
    def longest(self) -> int:
        return len(self.gains) - 1


def plan(candidates: Sequence[Candidate], draws: int, positions: int, room: int, times: DecodeTimes) -> list[int]:
    """Each candidate's draft length for a decode that already holds `positions` positions and `draws`
    drawing lanes, with room for `room` more: the lengths that make the decode's expected tokens per
    second highest, or every candidate's longest where it does not adapt.

    Of the lanes that adapt, only the one likeliest to gain drafts. llama.cpp decodes a batch whose
    sequences carry unequal numbers of positions in several passes (each KV stream takes as many
    positions as the others in a pass): every lane's first position in one, then the drafts, each run
    of consecutive drafting lanes in a pass of its own, and a pass costs about a decode of its lanes.
    One drafting lane adds one pass, which `DecodeTimes` measures as the decode's size; several would
    add passes that size does not tell."""
    lengths = [0] * len(candidates)
    tokens = float(draws)
    for i, c in enumerate(candidates):
        if not c.adaptive:
            lengths[i] = min(c.longest, room)
            room -= lengths[i]
            tokens += c.gains[lengths[i]]
            positions += lengths[i]
    adaptive = [i for i, c in enumerate(candidates) if c.adaptive]
    base = times.cost(draws, positions)
    if not adaptive or base is None:
        return lengths  # nothing measured yet: this decode measures
    i = max(adaptive, key=lambda k: candidates[k].gains[-1])
    gains = candidates[i].gains
    best_rate = tokens / base
    for n in range(1, min(len(gains) - 1, room) + 1):
        spent = times.cost(draws, positions + n)
        if spent is not None and (tokens + gains[n]) / spent > best_rate:
            lengths[i], best_rate = n, (tokens + gains[n]) / spent
    return lengths
