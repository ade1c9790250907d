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
AGREEMENT_CAP = 32  # agreement lengths told apart; longer ones count as this


@dataclass(frozen=True)
class Match:
    """Where a draft would come from: the stream position its continuation starts at, and how many
    tokens before that position equal the stream's last ones (at least the n-gram looked up)."""

    at: int
    agreed: int


class PromptLookup:
    """One lane's stream and the index of its n-grams: drafts are what followed the latest earlier
    occurrence of its last three (else two) tokens."""

    def __init__(self, stream: Sequence[int]) -> None:
        self.stream = list(stream)
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
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
                self._after.clear()
                self._indexed = 0
        stream.append(token)

    def match(self) -> Match | None:
        """Where the stream's end occurred before, if it did."""
        if self.lost:
            return None
        stream, after = self.stream, self._after
        end = len(stream)
        for e in range(self._indexed, end):  # stream[e - n : e] was followed by stream[e]
            for n in NGRAMS:
                if e >= n:
                    after[tuple(stream[e - n : e])] = e
        self._indexed = max(self._indexed, end)
        for n in NGRAMS:
            if end > n:
                at = after.get(tuple(stream[end - n :]))
                if at is not None:
                    agreed = n
                    while agreed < min(AGREEMENT_CAP, at) and stream[at - agreed - 1] == stream[end - agreed - 1]:
                        agreed += 1
                    return Match(at, agreed)
        return None

    def draft(self, match: Match, length: int) -> list[int]:
        """Up to `length` tokens of the continuation (fewer where the stream ends)."""
        return self.stream[match.at : match.at + length]

    def available(self, match: Match) -> int:
        return len(self.stream) - match.at


class Acceptance:
    """The odds that a drafted token stands, by its agreement: the tokens before it, in the draft and
    the stream, that equal its source's. Counts decay, so the odds follow the lanes' work."""

    PRIOR = 0.8  # optimistic: an agreement never tried is tried, then known
    DECAY = 0.99

    def __init__(self) -> None:
        self._stood = np.full(AGREEMENT_CAP + 1, self.PRIOR)
        self._tried = np.ones(AGREEMENT_CAP + 1)

    def odds(self, agreed: int) -> float:
        at = min(agreed, AGREEMENT_CAP)
        return float(self._stood[at] / self._tried[at])

    def record(self, agreed: int, drafted: int, stood: int) -> None:
        """A draft of `drafted` tokens after a match of `agreed`, whose first `stood` tokens stood."""
        for k in range(min(stood + 1, drafted)):  # the tokens after the first that failed were not tried
            at = min(agreed + k, AGREEMENT_CAP)
            self._stood[at] = self._stood[at] * self.DECAY + (k < stood)
            self._tried[at] = self._tried[at] * self.DECAY + 1

    def gains(self, agreed: int, longest: int) -> list[float]:
        """The tokens a draft of each length 0..longest is expected to add: the odds that its first k
        tokens all stand, summed over k."""
        standing, total, out = 1.0, 0.0, [0.0]
        for k in range(longest):
            standing *= self.odds(agreed + k)
            total += standing
            out.append(total)
        return out


class DecodeTimes:
    """Seconds a decode takes by the positions in its batch, as measured (recent decodes weigh most).

    A size not measured yet is guessed from its neighbours, optimistically above the largest one
    (each further position a quarter of the per-position cost below it), so that a draft that could
    pay is tried once and then known."""

    WEIGHT = 0.2  # of a new measurement
    GUESS = 0.25

    def __init__(self, largest: int) -> None:
        self._seconds = np.zeros(largest + 1)
        self._seen = np.zeros(largest + 1, dtype=bool)

    def add(self, positions: int, seconds: float) -> None:
        if positions >= len(self._seconds):
            return
        if self._seen[positions]:
            seconds = (1 - self.WEIGHT) * self._seconds[positions] + self.WEIGHT * seconds
        self._seconds[positions] = seconds
        self._seen[positions] = True

    def cost(self, positions: int) -> float | None:
        """The expected seconds of a decode of `positions`; None before any decode was measured."""
        seen = np.flatnonzero(self._seen)
        if not len(seen):
            return None
        positions = min(positions, len(self._seconds) - 1)
        if self._seen[positions]:
            return float(self._seconds[positions])
        below, above = seen[seen < positions], seen[seen > positions]
        if len(below) and len(above):
            lo, hi = int(below[-1]), int(above[0])
            return float(self._seconds[lo] + (self._seconds[hi] - self._seconds[lo]) * (positions - lo) / (hi - lo))
        if len(below):
            lo = int(below[-1])
            return float(self._seconds[lo] * (1 + self.GUESS * (positions - lo) / lo))
        hi = int(above[0])
        return float(self._seconds[hi] * positions / hi)


@dataclass(frozen=True)
class Candidate:
    """A lane that may draft this decode: its match and the longest draft it may carry."""

    match: Match
    longest: int
    adaptive: bool


def plan(
    candidates: Sequence[Candidate], draws: int, positions: int, room: int, acceptance: Acceptance, times: DecodeTimes
) -> list[int]:
    """Each candidate's draft length for a decode that already holds `positions` positions and `draws`
    drawing rows, with room for `room` more: the lengths that make the decode's expected tokens per
    second highest (each lane in turn, the others as chosen so far), or every candidate's longest
    where it does not adapt."""
    lengths = [0] * len(candidates)
    gains: list[list[float]] = []
    for i, c in enumerate(candidates):
        if c.adaptive:
            gains.append(acceptance.gains(c.match.agreed, c.longest))
        else:
            lengths[i] = min(c.longest, room)
            room -= lengths[i]
            gains.append([])
    tokens = draws + sum(acceptance.gains(c.match.agreed, n)[-1] for c, n in zip(candidates, lengths, strict=True) if n)
    positions += sum(lengths)
    costs: dict[int, float | None] = {}

    def cost(size: int) -> float | None:
        if size not in costs:
            costs[size] = times.cost(size)
        return costs[size]

    order = sorted((i for i, c in enumerate(candidates) if c.adaptive), key=lambda i: -gains[i][-1])
    for i in order:
        base = cost(positions)
        if base is None:
            break  # nothing measured yet: this decode measures
        best, best_rate = 0, tokens / base
        for n in range(1, min(len(gains[i]) - 1, room) + 1):
            spent = cost(positions + n)
            if spent is not None and (tokens + gains[i][n]) / spent > best_rate:
                best, best_rate = n, (tokens + gains[i][n]) / spent
        lengths[i] = best
        tokens += gains[i][best]
        positions += best
        room -= best
    return lengths
