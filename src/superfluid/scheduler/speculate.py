"""Speculative decoding by prompt lookup: a lane's next tokens drafted from its own stream.

Agents spend much of their decode rewriting text they were just shown. `PromptLookup`
drafts the tokens that followed the latest earlier occurrence of the stream's last few
tokens (an n-gram index kept up to date as the stream grows, so a draft is a dict lookup);
the scheduler puts the draft into the lane's next decode and the engine keeps the longest
prefix of it that the lane would have drawn anyway, plus the token drawn after it.

`SpecGate` decides, under `--speculate auto`, whether drafting pays on this machine and load:
for each batch size apart, it measures the decode rate of steps with drafts allowed and
without, alternately, keeps drafting while it is at least `min_speedup` faster, and measures
again every few hundred steps.
`LaneSpec` is one job's share: its drafter, its acceptance, and under `--spec-adaptive` how long
its drafts may be.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("superfluid.scheduler")

NGRAMS = (3, 2)  # a single token repeats too often to predict what follows it
PROBE_STEPS = 12  # decode-only steps (engine calls, each up to a run of tokens) measured each way
HOLD_STEPS = 1000  # steps a decision stands before the next probe
ADAPT_AFTER = 8  # proposals before a lane's acceptance steers its draft length
PAUSE_STEPS = 64  # a lane whose drafts are almost never taken stops drafting this long


@dataclass(frozen=True)
class SpecSettings:
    """What `serve` was told: `--speculate`, `--spec-draft-tokens`, `--spec-adaptive`, `--spec-min-speedup`.

    `exact` says whether the kernels compute a token the same whatever its batch; where they do
    not, a batch-invariant lane never drafts (its verified tokens would come from a batch shape
    its uncut run never had)."""

    mode: str = "off"  # off, auto or prompt-lookup
    draft_tokens: int = 4
    adaptive: bool = False
    min_speedup: float = 1.08
    exact: bool = True


class PromptLookup:
    """Drafts from the stream itself: the tokens that followed the latest earlier occurrence of its last n-gram."""

    def __init__(self) -> None:
        self._after: dict[tuple[int, ...], int] = {}  # n-gram -> the position that followed its latest occurrence
        self._indexed = 0  # positions below this are in the index

    def draft(self, held: Sequence[int], last: int, limit: int) -> list[int]:
        """Up to `limit` tokens to follow the stream `held + [last]`; empty when nothing matches."""
        end = len(held)  # the stream's positions 0..end, `last` at `end`
        for e in range(max(self._indexed, 1), end + 1):
            for n in NGRAMS:
                if e >= n:
                    self._after[tuple(held[e - n : e])] = e
        self._indexed = end + 1
        for n in NGRAMS:
            if end + 1 > n:
                at = self._after.get((*held[end + 1 - n : end], last))
                if at is not None:
                    # what followed it; `at` <= end, and at `end` itself stands `last`
                    following = [*held[at : at + limit]]
                    if len(following) < limit and at + len(following) == end:
                        following.append(last)
                    return following[:limit]
        return []


class DecodeCost:
    """What a decode costs by the positions in its batch: a straight line, fitted by least squares
    to the recent decodes (older ones weigh less), as `a + b * positions` seconds."""

    DECAY = 0.98

    def __init__(self) -> None:
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def add(self, positions: int, seconds: float) -> None:
        w, x, y, xx, xy = (v * self.DECAY for v in self._sums)
        self._sums = [w + 1, x + positions, y + seconds, xx + positions * positions, xy + positions * seconds]

    def line(self) -> tuple[float, float] | None:
        """(a, b); None until decodes of at least two batch sizes were measured."""
        w, x, y, xx, xy = self._sums
        spread = w * xx - x * x
        if w < 4 or spread <= 1e-6 * max(1.0, w * xx):
            return None
        b = (w * xy - x * y) / spread
        a = (y - b * x) / w
        return (a, b) if b > 0 and a + b > 0 else None


@dataclass
class LaneSpec:
    """One job's speculation: its drafter and how its drafts fare.

    Drafts are taken position by position until one differs, so `alpha`, the chance that the
    next drafted token stands given that the ones before it did, sums up a lane. Under
    `--spec-adaptive` a draft is as long as pays best: the length d whose expected tokens,
    1 + alpha + ... + alpha^d, are most per the decode's time for this lane, its share of a
    plain decode plus d drafted positions (`DecodeCost`)."""

    max_draft: int
    adaptive: bool
    lookup: PromptLookup = field(default_factory=PromptLookup)
    proposed: int = 0
    accepted: int = 0
    stood: float = 4.0  # drafted positions that stood, and drafts cut short: decayed counts, a prior of 0.8
    cut: float = 1.0
    paused_until: int = 0  # a step number
    explore: bool = False  # after a pause, one full draft measures the lane again

    @property
    def alpha(self) -> float:
        return self.stood / (self.stood + self.cut)

    def length(self, step: int, relative_cost: float | None) -> int:
        """How many tokens this lane may draft at `step`; `relative_cost` is a drafted position's cost
        over a plain lane's share of a decode (None while it is unknown)."""
        if step < self.paused_until:
            return 0
        if not self.adaptive or relative_cost is None or self.proposed < ADAPT_AFTER or self.explore:
            self.explore = False
            return self.max_draft
        alpha, best, best_rate = self.alpha, 0, 1.0
        expected, term = 1.0, 1.0
        for d in range(1, self.max_draft + 1):
            term *= alpha
            expected += term
            rate = expected / (1.0 + relative_cost * d)
            if rate > best_rate:
                best, best_rate = d, rate
        if not best:  # no draft pays now: pause, then measure again, as for a lane whose drafts fail
            self.pause(step)
        return best

    def pause(self, step: int) -> None:
        self.paused_until = step + PAUSE_STEPS
        self.explore = True

    def record(self, step: int, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.stood = 0.9 * self.stood + accepted
        self.cut = 0.9 * self.cut + (accepted < proposed)
        if self.adaptive and self.proposed >= ADAPT_AFTER and self.alpha < 0.1:
            self.pause(step)
            self.stood, self.cut = 4.0, 1.0  # after the pause it tries again, from the prior


class SpecGate:
    """Whether steps may draft (`--speculate auto`), decided apart for each batch size (1, 2-3, 4-7 or 8
    and more decoding lanes: what pays for one stream can cost eight): each probes without drafts and
    with them, and keeps the faster."""

    def __init__(self, min_speedup: float) -> None:
        self.min_speedup = min_speedup
        self._probes: dict[int, SpecProbe] = {}

    def probe(self, lanes: int) -> SpecProbe:
        bucket = min(lanes.bit_length(), 4)  # 1, 2-3, 4-7, 8+
        return self._probes.setdefault(bucket, SpecProbe(self.min_speedup))

    def allows(self, lanes: int) -> bool:
        return self.probe(lanes).allows()

    def record(self, lanes: int, tokens: int, seconds: float) -> None:
        self.probe(lanes).record(tokens, seconds)


class SpecProbe:
    """One batch size's decision: probes without drafts, then with them, keeps the faster for a while."""

    def __init__(self, min_speedup: float) -> None:
        self.min_speedup = min_speedup
        self.phase = "off"  # "off" or "on": the probe under way, then "hold"
        self.drafting = False
        self._steps = 0
        self._rate: dict[str, tuple[int, float]] = {"off": (0, 0.0), "on": (0, 0.0)}  # tokens, seconds
        self.speedup = 0.0  # the last probe's measured ratio

    def allows(self) -> bool:
        """True when this step may carry drafts."""
        return self.drafting if self.phase == "hold" else self.phase == "on"

    def record(self, tokens: int, seconds: float) -> None:
        """A decode-only step: the tokens it drew and its time."""
        self._steps += 1
        if self.phase in self._rate:
            count, took = self._rate[self.phase]
            self._rate[self.phase] = (count + tokens, took + seconds)
            if self._steps >= PROBE_STEPS:
                self._steps = 0
                if self.phase == "off":
                    self.phase = "on"
                else:
                    self._decide()
        elif self._steps >= HOLD_STEPS:
            self._steps = 0
            self.phase = "off"
            self._rate = {"off": (0, 0.0), "on": (0, 0.0)}

    def _decide(self) -> None:
        (off_tokens, off_s), (on_tokens, on_s) = self._rate["off"], self._rate["on"]
        off, on = off_tokens / max(off_s, 1e-9), on_tokens / max(on_s, 1e-9)
        self.speedup = on / off if off else 0.0
        self.drafting = self.speedup >= self.min_speedup
        self.phase = "hold"
        log.info(
            "speculation %s: drafts measured %.2fx plain decoding (%.0f vs %.0f tok/s; kept at %.2fx or more)",
            "on" if self.drafting else "off",
            self.speedup,
            on,
            off,
            self.min_speedup,
        )
