"""Speculative decoding as the scheduler sees it: what `serve` was told, and whether drafts pay.

Agents spend much of their decode rewriting text they were just shown. The engine drafts a
lane's next tokens from the lane's own stream and verifies them in its decodes
(`engine/drafting.py`); the scheduler opens a drafter for each job that may draft, tells each
step how long its drafts may be, and counts what they saved.

`SpecGate` decides, under `--speculate auto`, whether drafting pays on this machine and load:
for each batch size apart, it measures the decode rate of steps with drafts allowed and
without, in turns, keeps drafting while it is at least `min_speedup` faster, and measures
again soon after a new decision, and twice as late after each decision that stood, up to 1,024
steps later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("superfluid.scheduler")

# decode-only steps (engine calls, each up to a run of tokens) a probe measures, and one in how many of
# them goes without drafts
PROBE_STEPS = 32
PLAIN_EVERY = 4
HOLD_MIN = 32  # steps a new decision stands before the next probe: the engine learned its odds meanwhile
HOLD_STEPS = 1024  # and the longest, for one that kept standing


@dataclass(frozen=True)
class SpecSettings:
    """What `serve` was told: `--speculate`, `--spec-draft-tokens`, `--spec-adaptive`, `--spec-min-speedup`.

    `exact` says whether the kernels compute a token the same whatever its batch; where they do
    not, a batch-invariant lane never drafts (its verified tokens would come from a batch shape
    its uncut run never had)."""

    mode: str = "off"  # off, auto or prompt-lookup
    draft_tokens: int = 4
    adaptive: bool = True
    min_speedup: float = 1.08
    exact: bool = True


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
    """One batch size's decision: probes steps without drafts and with them in turns (so both see the same
    stretch of text and the same machine), keeps the faster for a while, and probes again.

    A plain step's rate hardly depends on the text, a drafting one's does (a copied stretch drafts well,
    the line after it not): of a probe's `PROBE_STEPS` steps, one in `PLAIN_EVERY` goes without drafts.
    A decision that stands when probed again holds twice as long the next time, from `HOLD_MIN` up to
    `HOLD_STEPS` steps; a first one, or one that flips, holds `HOLD_MIN` steps: a probe made while the
    engine was still learning its lanes' odds is soon corrected."""

    def __init__(self, min_speedup: float) -> None:
        self.min_speedup = min_speedup
        self.probing = True
        self.drafting = False
        self.decisions = 0
        self.hold = HOLD_MIN
        self._steps = 0
        self._rate: dict[bool, tuple[int, float]] = {False: (0, 0.0), True: (0, 0.0)}  # tokens, seconds
        self.speedup = 0.0  # the last probe's measured ratio

    @property
    def phase(self) -> str:
        return "probe" if self.probing else "hold"

    def allows(self) -> bool:
        """True when this step may carry drafts."""
        return self._steps % PLAIN_EVERY != 0 if self.probing else self.drafting

    def record(self, tokens: int, seconds: float) -> None:
        """A decode-only step: the tokens it drew and its time."""
        if self.probing:
            drafted = self.allows()
            count, took = self._rate[drafted]
            self._rate[drafted] = (count + tokens, took + seconds)
        self._steps += 1
        if self.probing and self._steps >= PROBE_STEPS:
            self._decide()
        elif not self.probing and self._steps >= self.hold:
            self.probing, self._steps = True, 0
            self._rate = {False: (0, 0.0), True: (0, 0.0)}

    def _decide(self) -> None:
        (off_tokens, off_s), (on_tokens, on_s) = self._rate[False], self._rate[True]
        off, on = off_tokens / max(off_s, 1e-9), on_tokens / max(on_s, 1e-9)
        self.speedup = on / off if off else 0.0
        drafting = self.speedup >= self.min_speedup
        stood = self.decisions and drafting == self.drafting
        self.hold = min(2 * self.hold, HOLD_STEPS) if stood else HOLD_MIN
        self.drafting, self.probing, self._steps = drafting, False, 0
        self.decisions += 1
        log.info(
            "speculation %s: drafts measured %.2fx plain decoding (%.0f vs %.0f tok/s; kept at %.2fx or more); "
            "probed again in %d steps",
            "on" if drafting else "off",
            self.speedup,
            on,
            off,
            self.min_speedup,
            self.hold,
        )
