"""Speculative decoding as the scheduler sees it: what `serve` was told, and whether drafts pay.

Agents spend much of their decode rewriting text they were just shown. The engine drafts a
lane's next tokens from the lane's own stream and verifies them in its decodes
(`engine/drafting.py`); the scheduler opens a drafter for each job that may draft, tells each
step how long its drafts may be, and counts what they saved.

`SpecGate` decides, under `--speculate auto`, whether drafting pays on this machine and load, for
each batch size apart: it has the engine try, where it plans drafts, decodes without them now and
then, keeps drafting while drafts decode at least `min_speedup` times as fast, and probes again
after a while, and twice as late after each decision that stood.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..engine.drafting import Arm

log = logging.getLogger("superfluid.scheduler")

TRIALS = 8  # plain decodes a probe waits for (three times as many drafting ones come with them)
HOLD_MIN = 64  # decodes a new decision stands before the next probe
HOLD_MAX = 2048  # and the longest, for one that kept standing


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
    and more decoding lanes: what pays for one stream can cost eight)."""

    def __init__(self, min_speedup: float) -> None:
        self.min_speedup = min_speedup
        self._probes: dict[int, SpecProbe] = {}

    def probe(self, lanes: int) -> SpecProbe:
        bucket = min(lanes.bit_length(), 4)  # 1, 2-3, 4-7, 8+
        return self._probes.setdefault(bucket, SpecProbe(self.min_speedup))

    def allows(self, lanes: int) -> bool:
        return self.probe(lanes).allows()

    def probing(self, lanes: int) -> bool:
        return self.probe(lanes).probing

    def record(self, lanes: int, decodes: int, drafted: Arm, plain: Arm) -> None:
        self.probe(lanes).record(decodes, drafted, plain)


class SpecProbe:
    """One batch size's decision, from trials: while it probes, the engine leaves one in `PLAIN_EVERY` of
    the decodes where it plans drafts without them (`Step.probe`), so drafting is measured against none
    on the same stretches of text, the same lanes and the same machine; once `TRIALS` plain ones are in,
    drafting is kept while its tokens per second are at least `min_speedup` times the plain ones'.

    A decision holds `HOLD_MIN` decodes, then the next probe; a decision that stands when probed again
    holds twice as long the next time, up to `HOLD_MAX`. Decodes where the engine plans no draft are the
    same either way, and a probe waits for enough of the others."""

    def __init__(self, min_speedup: float) -> None:
        self.min_speedup = min_speedup
        self.probing = True
        self.drafting = False
        self.decisions = 0
        self.hold = HOLD_MIN
        self._decodes = 0
        self._drafted, self._plain = Arm(), Arm()
        self.speedup = 0.0  # the last probe's measured ratio

    @property
    def phase(self) -> str:
        return "probe" if self.probing else "hold"

    def allows(self) -> bool:
        """True when this step may carry drafts (a probe's steps do: the engine leaves some plain)."""
        return self.probing or self.drafting

    def record(self, decodes: int, drafted: Arm, plain: Arm) -> None:
        """A decode-only step: its decodes, and its trial's two arms."""
        if self.probing:
            self._drafted.add(drafted)
            self._plain.add(plain)
            if self._plain.decodes >= TRIALS:
                self._decide()
            return
        self._decodes += decodes
        if self._decodes >= self.hold:
            self.probing, self._decodes = True, 0
            self._drafted, self._plain = Arm(), Arm()

    def _decide(self) -> None:
        drafted, plain = self._drafted.rate, self._plain.rate
        self.speedup = drafted / plain if plain else 0.0
        drafting = self.speedup >= self.min_speedup
        stood = self.decisions and drafting == self.drafting
        self.hold = min(2 * self.hold, HOLD_MAX) if stood else HOLD_MIN
        self.drafting, self.probing = drafting, False
        self.decisions += 1
        log.info(
            "speculation %s: where drafts are planned, they decode %.2fx as fast as none (%.0f vs %.0f tok/s over "
            "%d and %d decodes; kept at %.2fx or more); probed again in %d decodes",
            "on" if drafting else "off",
            self.speedup,
            drafted,
            plain,
            self._drafted.decodes,
            self._plain.decodes,
            self.min_speedup,
            self.hold,
        )
