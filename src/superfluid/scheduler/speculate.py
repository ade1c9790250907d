"""Speculative decoding as the scheduler sees it: what `serve` was told, and whether drafts pay.

Agents spend much of their decode rewriting text they were just shown. The engine drafts a
lane's next tokens from the lane's own stream and verifies them in its decodes
(`engine/drafting.py`); the scheduler opens a drafter for each job that may draft, tells each
step how long its drafts may be, and counts what they saved.

`SpecGate` decides, under `--speculate auto`, whether drafting pays on this machine and load, for
each batch size apart: it has the engine try, where it plans drafts, decodes without them now and
then, keeps drafting while drafts decode at least `min_speedup` times as fast, and probes again
after a while, and twice as late after each decision that stood; or at once, when the drafted
tokens that stand fall well below their share in the probe (the lanes' text changed: a chat
after a rewritten file).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..engine.drafting import Arm

if TYPE_CHECKING:
    from .job import Job

log = logging.getLogger("superfluid.scheduler")

TRIALS = 8  # plain decodes a probe waits for (three times as many drafting ones come with them)
PROBE_MAX = 128  # decodes a probe waits for them; where drafts are planned more seldom, none are kept
SELDOM_HOLD = 256  # the shortest hold of such a decision
HOLD_MIN = 64  # decodes a new decision stands before the next probe
HOLD_MAX = 2048  # and the longest, for one that kept standing
BUCKETS = ("1 lane", "2-3 lanes", "4-7 lanes", "8 lanes or more")  # decided apart
WATCH = 128  # drafted tokens over which a hold's acceptance is compared with the probe's
CHANGED = 0.5  # a hold whose drafted tokens stand less than this share of the probe's probes again


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
        if bucket not in self._probes:
            self._probes[bucket] = SpecProbe(self.min_speedup, BUCKETS[bucket - 1])
        return self._probes[bucket]

    def allows(self, lanes: int) -> bool:
        return self.probe(lanes).allows()

    def probing(self, lanes: int) -> bool:
        return self.probe(lanes).probing

    def record(self, lanes: int, decodes: int, drafted: Arm, plain: Arm, proposed: int = 0, accepted: int = 0) -> None:
        self.probe(lanes).record(decodes, drafted, plain, proposed, accepted)


class SpecProbe:
    """One batch size's decision, from trials: while it probes, the engine leaves one in `PLAIN_EVERY` of
    the decodes where it plans drafts without them (`Step.probe`), so drafting is measured against none
    on the same stretches of text, the same lanes and the same machine; once `TRIALS` plain ones are in,
    drafting is kept while its tokens per second are at least `min_speedup` times the plain ones'.

    A decision holds `HOLD_MIN` decodes, then the next probe; a decision that stands when probed again
    holds twice as long the next time, up to `HOLD_MAX`. Decodes where the engine plans no draft are the
    same either way, and a probe waits for enough of the others, up to `PROBE_MAX` decodes: where the
    engine plans drafts more seldom than that (several lanes on a CPU, where a draft costs llama.cpp a
    pass of its own), they cannot gain much, while a probe that waited longer would draft all along,
    so drafting stops, for at least `SELDOM_HOLD` decodes.

    A decision to draft was measured on text whose drafts stood so often; while it holds, each `WATCH`
    drafted tokens are compared with that share, and a hold whose drafts stand less than `CHANGED` times as
    often ends in a probe at once, whose decision holds briefly again (a long hold earned rewriting files
    says nothing about the chat that follows)."""

    def __init__(self, min_speedup: float, lanes: str = BUCKETS[0]) -> None:
        self.min_speedup = min_speedup
        self.lanes = lanes  # the batch sizes it decides for, as its log lines say
        self.probing = True
        self.drafting = False
        self.decisions = 0
        self.hold = HOLD_MIN
        self._decodes = 0
        self._drafted, self._plain = Arm(), Arm()
        self.speedup = 0.0  # the last probe's measured ratio
        self.acceptance = 0.0  # the share of its drafted tokens that stood
        self._proposed = self._accepted = 0  # drafted tokens, and those that stood, in this probe or watch
        self._changed = False  # the last hold ended because its drafts stood less often

    @property
    def phase(self) -> str:
        return "probe" if self.probing else "hold"

    def allows(self) -> bool:
        """True when this step may carry drafts (a probe's steps do: the engine leaves some plain)."""
        return self.probing or self.drafting

    def record(self, decodes: int, drafted: Arm, plain: Arm, proposed: int = 0, accepted: int = 0) -> None:
        """A decode-only step: its decodes, its trial's two arms, and its drafted tokens and those that stood."""
        self._proposed += proposed
        self._accepted += accepted
        self._decodes += decodes
        if self.probing:
            self._drafted.add(drafted)
            self._plain.add(plain)
            if self._plain.decodes >= TRIALS or self._decodes >= PROBE_MAX:
                self._decide()
            return
        if self.drafting and self._proposed >= WATCH:
            share = self._accepted / self._proposed
            if share < CHANGED * self.acceptance:
                log.info(
                    "speculation at %s: drafted tokens stand %.0f%% of the time, against %.0f%% when it was "
                    "decided; probing again",
                    self.lanes,
                    100 * share,
                    100 * self.acceptance,
                )
                self._changed = True
                self._probe()
                return
            self._proposed = self._accepted = 0
        if self._decodes >= self.hold:
            self._probe()

    def _probe(self) -> None:
        self.probing, self._decodes = True, 0
        self._drafted, self._plain = Arm(), Arm()
        self._proposed = self._accepted = 0

    def _decide(self) -> None:
        drafted, plain = self._drafted.rate, self._plain.rate
        measured = self._plain.decodes >= TRIALS
        self.speedup = drafted / plain if measured and plain else 0.0
        self.acceptance = self._accepted / self._proposed if self._proposed else 0.0
        drafting = measured and self.speedup >= self.min_speedup
        stood = self.decisions and not self._changed and drafting == self.drafting
        self.hold = min(2 * self.hold, HOLD_MAX) if stood else HOLD_MIN
        if not measured:  # the plan itself seldom finds a draft worth making: a probe soon would tell little
            self.hold = max(self.hold, SELDOM_HOLD)
        self.drafting, self.probing = drafting, False
        self.decisions += 1
        if measured:
            log.info(
                "speculation %s at %s: where drafts are planned, they decode %.2fx as fast as none (%.0f vs %.0f "
                "tok/s over %d and %d decodes, %.0f%% of drafted tokens standing; kept at %.2fx or more); "
                "probed again in %d decodes",
                "on" if drafting else "off",
                self.lanes,
                self.speedup,
                drafted,
                plain,
                self._drafted.decodes,
                self._plain.decodes,
                100 * self.acceptance,
                self.min_speedup,
                self.hold,
            )
        else:
            log.info(
                "speculation off at %s: drafts were planned in %d of %d decodes, too seldom to gain; probed again "
                "in %d decodes",
                self.lanes,
                self._drafted.decodes + self._plain.decodes,
                self._decodes,
                self.hold,
            )
        self._changed = False
        self._decodes = 0
        self._proposed = self._accepted = 0


class SpecPolicy:
    """What `--speculate` means for each step and job: who drafts, how long, and (under auto) the gate."""

    def __init__(self, settings: SpecSettings | None) -> None:
        self.settings = settings if settings is not None and settings.mode != "off" else None
        auto = self.settings is not None and self.settings.mode == "auto"
        self.gate = SpecGate(self.settings.min_speedup) if self.settings is not None and auto else None

    @property
    def adaptive(self) -> bool:
        """Drafts as long as pays (`drafting.plan`), else always the longest there is."""
        return self.settings is None or self.settings.adaptive

    def draft_length(self, lanes: int, decode_only: bool) -> int:
        """The longest draft this step's lanes may carry: none with speculation off, while a prompt
        prefills (a draft would only lengthen that step), or while the gate (under auto) finds that
        drafts do not pay for this many lanes."""
        if self.settings is None or not decode_only or (self.gate is not None and not self.gate.allows(lanes)):
            return 0
        return self.settings.draft_tokens

    def probing(self, lanes: int) -> bool:
        """Whether a step of this many decoding lanes is a trial of drafting against none (under auto)."""
        return self.gate is not None and self.gate.probing(lanes)

    def may_draft(self, job: Job) -> bool:
        """Whether a job gets a drafter: not where drafts cannot be verified as the job would draw its
        tokens (log probabilities asked, a batch-invariant job on kernels that are not exact)."""
        if self.settings is None or job.prefill_only:
            return False
        if job.shaping is not None and job.shaping.logprobs >= 0:
            return False
        return self.settings.exact or not job.batch_invariant

    def record(self, lanes: int, decodes: int, drafted: Arm, plain: Arm, proposed: int, accepted: int) -> None:
        """A decode-only step's drafting, for the gate."""
        if self.gate is not None:
            self.gate.record(lanes, decodes, drafted, plain, proposed, accepted)
