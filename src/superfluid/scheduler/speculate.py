"""Speculative decoding as the scheduler sees it: what `serve` was told, and whether drafts pay.

Agents spend much of their decode rewriting text they were just shown. The engine drafts a
lane's next tokens from the lane's own stream and verifies them in its decodes
(`engine/drafting.py`); the scheduler opens a drafter for each job that may draft, tells each
step how long its drafts may be, and counts what they saved.

`SpecGate` decides, under `--speculate auto`, whether drafting pays on this machine and load:
for each batch size apart, it measures the decode rate of steps with drafts allowed and
without, alternately, keeps drafting while it is at least `min_speedup` faster, and measures
again every thousand steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("superfluid.scheduler")

PROBE_STEPS = 12  # decode-only steps (engine calls, each up to a run of tokens) measured each way
HOLD_STEPS = 1000  # steps a decision stands before the next probe


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
