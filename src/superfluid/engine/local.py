"""`LocalEngine`: the `Engine` (`interface.py`) with llama.cpp in this process.

It runs steps: decode, then sample each wanted row, shaped (bias, penalties) and masked by
the lane's grammar, which then accepts the token; a lane whose shaping asks for log
probabilities gets them back in the step's `logprobs`.

A lane with a drafter (`drafting.py`) may carry a draft into each of its decodes: the tokens
prompt lookup expects next, one position each, right after its input. Each drafted position's
row is drawn as the lane would draw it anyway (the same sampler, the same position-keyed
draw), the draft stands up to the first token that differs from what was drawn before it, and
the lane's KV loses the rest; so drafts change the number of decodes, never a token.
The worker process (`worker.py`) serves the same calls over its channel, so the scheduler
never knows which one it drives. `embed` pools one input on a second context, called by the
HTTP routes from their own threads, never by the scheduler.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np

from .drafting import PLAIN_EVERY, Acceptance, Arm, Candidate, DecodeTimes, Drafter, Match, PromptLookup, plan
from .grammar import Grammar
from .heap import keep_heap_slack
from .interface import DeviceReport, Draw, EngineError, KVFull, Step, StepInterrupted
from .llama import EmbeddingContext, LlamaContext
from .sampling import sample
from .shaping import Shaper, Shaping, log_softmax_row

T = TypeVar("T")


class LocalEngine:
    """llama.cpp in this process: a context, and the grammars, shapings and drafters of the lanes that have one."""

    def __init__(self, context: LlamaContext) -> None:
        keep_heap_slack()  # the rows it samples allocate the same temporaries at every token
        self.context = context
        self.shape = context.shape
        self.interrupt = context.interrupt
        self.end_of_generation = context.model.end_of_generation
        self._grammars: dict[int, Grammar] = {}
        self._shapers: dict[int, Shaper] = {}
        self._drafters: dict[int, Drafter] = {}
        self.acceptance = Acceptance()  # every lane's odds start from these
        self.decode_times = DecodeTimes(context.shape.batch)
        self._trials = 0  # decodes of probes where drafts were planned
        self._handles = itertools.count(1)
        self._embedder: EmbeddingContext | None = None  # made on the first embedding asked for
        self._embedding = threading.Lock()  # one embedding at a time: requests come from several threads

    @property
    def copy_pending(self) -> bool:
        return self.context.copy_pending

    def device_report(self) -> DeviceReport:
        """The devices llama.cpp sees, their memory now, and where the model's layers are (`LlamaModel`)."""
        return self.context.model.device_report()

    def step(self, step: Step) -> list[list[int]]:
        draws = step.draws
        drawn: list[list[int]] = [[] for _ in draws]
        rows = np.flatnonzero(step.want)
        lane_seq = [int(s) for s in step.seqs[rows]]  # by draw
        batch = Batch(step.tokens, step.positions, step.seqs, step.want, rows)
        lanes = list(range(len(draws)))  # the draws still drawing, in their rows' order
        decode_only = bool(step.want.all())  # no prompt in the batch: its time is a decode's
        while True:
            started = time.perf_counter()
            drafts, matches = self._drafts(draws, lanes, batch, drawn)
            arm = None
            if step.probe and any(drafts):
                self._trials += 1
                arm = step.plain if self._trials % PLAIN_EVERY == 0 else step.drafted
                if arm is step.plain:
                    drafts, matches = [[] for _ in lanes], [None] * len(lanes)
            before = sum(len(drawn[i]) for i in lanes) if arm is not None else 0
            try:
                logits, took, drafts = self._decode(batch, drafts)
            except (KVFull, StepInterrupted):
                if step.decodes:
                    break  # what was drawn stands; the scheduler decodes the last tokens when there is room
                raise
            if not step.decodes:
                step.first_decode_s = took
            step.decodes += 1
            if decode_only:
                self.decode_times.add(len(lanes), len(batch.tokens) + sum(map(len, drafts)), took)
            row = 0  # the logits rows: each lane's input, then its drafted positions
            for k, i in enumerate(lanes):
                draft = drafts[k]
                stood = self._take(step, i, logits, row, draft, drawn[i])
                row += 1 + len(draft)
                match = matches[k]
                if draft and match is not None:
                    drafter = self._drafters[draws[i].drafter]
                    self._settle(drafter.lookup, int(batch.positions[batch.rows[k]]), lane_seq[i], draft, stood)
                    drafter.acceptance.record(match.agreed, len(draft), stood)
                    tried, kept = step.spec.get(i, (0, 0))
                    step.spec[i] = (tried + len(draft), kept + stood)
            if arm is not None:
                drew = sum(len(drawn[i]) for i in lanes) - before
                arm.add(Arm(1, drew, time.perf_counter() - started))
            going = [
                i
                for i in lanes
                if step.decodes < draws[i].run
                and len(drawn[i]) < draws[i].limit
                and not self.end_of_generation[drawn[i][-1]]
            ]
            # a run ends with its last decode, when any of its lanes ends (so its finish is not held back by
            # the others), or when someone arrived (`Interrupt.cut`); what was drawn stands
            if not going or len(going) < len(lanes) or (self.interrupt is not None and self.interrupt.is_cut()):
                break
            lanes = going
            if step.on_decode is not None:
                step.on_decode(drawn)
            # the next decode: each running lane's last token, as the scheduler would send it
            batch = Batch.of_inputs(
                [drawn[i][-1] for i in lanes],
                [draws[i].position + len(drawn[i]) - 1 for i in lanes],
                [lane_seq[i] for i in lanes],
            )
            decode_only = True
        return drawn

    def _drafts(
        self, draws: list[Draw], lanes: list[int], batch: Batch, drawn: list[list[int]]
    ) -> tuple[list[list[int]], list[Match | None]]:
        """Each lane's draft for this decode (by its place in `lanes`), and the match it came from.

        Every drafter first takes its lane's input, whether or not the lane drafts now: it must
        see the whole stream."""
        drafts: list[list[int]] = [[] for _ in lanes]
        matches: list[Match | None] = [None] * len(lanes)
        candidates: list[tuple[int, PromptLookup, Match]] = []
        choices: list[Candidate] = []
        for k, i in enumerate(lanes):
            draw = draws[i]
            if not draw.drafter:
                continue
            drafter = _opened(self._drafters, draw.drafter, "drafter")
            row = batch.rows[k]
            drafter.lookup.feed(int(batch.positions[row]), int(batch.tokens[row]))
            longest = min(draw.draft, draw.limit - len(drawn[i]) - 1)  # the drafts and the token after them
            match = drafter.lookup.match() if longest > 0 else None
            if match is not None:
                longest = min(longest, drafter.lookup.available(match))
                candidates.append((k, drafter.lookup, match))
                choices.append(Candidate(drafter.acceptance.gains(match.agreed, longest), draw.adaptive))
        if candidates:
            room = self.shape.batch - len(batch.tokens)
            lengths = plan(choices, len(lanes), len(batch.tokens), room, self.decode_times)
            for (k, lookup, match), length in zip(candidates, lengths, strict=True):
                if length:
                    drafts[k] = lookup.draft(match, length)
                    matches[k] = match
        return drafts, matches

    def _decode(self, batch: Batch, drafts: list[list[int]]) -> tuple[np.ndarray, float, list[list[int]]]:
        """The logits rows of a decode of the batch with its drafts, its time, and the drafts it carried:
        none when the KV has no room for them (KVFull when it has none for the batch itself)."""
        try:
            started = time.perf_counter()
            logits = self.context.decode(*batch.with_drafts(drafts))
            return logits, time.perf_counter() - started, drafts
        except KVFull:
            if not any(drafts):
                raise
        started = time.perf_counter()
        logits = self.context.decode(batch.tokens, batch.positions, batch.seqs, batch.want)
        return logits, time.perf_counter() - started, [[] for _ in drafts]

    def _take(self, step: Step, i: int, logits: np.ndarray, row: int, draft: list[int], picks: list[int]) -> int:
        """Draw from draw `i`'s row, then from each drafted row while the draft stands (each drafted token is
        the one drawn before it); returns how many drafted tokens stood."""
        draw = step.draws[i]
        picks.append(self._pick(step, i, logits[row], replace(draw, position=draw.position + len(picks))))
        for j, token in enumerate(draft):
            if picks[-1] != token or self.end_of_generation[token]:
                return j
            picks.append(self._pick(step, i, logits[row + 1 + j], replace(draw, position=draw.position + len(picks))))
        return len(draft)

    def _settle(self, lookup: PromptLookup, position: int, seq: int, draft: list[int], stood: int) -> None:
        """After a draft behind the input at `position`: the lane's KV loses the drafted tokens that did
        not stand, and its lookup takes those that did (they are inputs now)."""
        if stood < len(draft):
            self.context.truncate(seq, position + 1 + stood)
        for j in range(stood):
            lookup.feed(position + 1 + j, draft[j])

    def _pick(self, step: Step, index: int, row: np.ndarray, draw: Draw) -> int:
        """The token one draw picks from its row, shaped; its log probabilities go into the step."""
        shaper = _opened(self._shapers, draw.shaping, "shaping") if draw.shaping else None
        if shaper is None:
            return self._draw(row, draw)
        asked = shaper.shaping.logprobs
        raw = row.copy() if asked >= 0 else None  # log probabilities are of the model's own row
        shaper.apply(row)
        token = self._draw(row, draw)
        shaper.accept(token)
        if raw is not None:
            if draw.run > 1 or draw.draft:
                raise EngineError("a draw that asks for log probabilities runs one decode and drafts nothing")
            step.logprobs[index] = log_softmax_row(raw, token, asked)
        return token

    def _draw(self, logits: np.ndarray, draw: Draw) -> int:
        grammar = _opened(self._grammars, draw.grammar, "grammar") if draw.grammar else None
        if grammar is None:
            if draw.ignore_eos:  # a grammar decides for itself when it is complete
                logits[self.end_of_generation] = -np.inf
            return sample(logits, draw.params, draw.position)
        token = int(np.argmax(logits))
        if draw.params.temperature > 0 or not grammar.allows(token):
            token = sample(grammar.mask(logits), draw.params, draw.position)
        if not self.end_of_generation[token]:
            grammar.accept(token)
        return token

    def copy(self, source: int, target: int, length: int) -> None:
        self.context.copy(source, target, length)

    def truncate(self, seq: int, length: int) -> None:
        self.context.truncate(seq, length)

    def export(self, seq: int) -> bytes:
        return self.context.export(seq)

    def restore(self, seq: int, data: bytes | memoryview) -> None:
        self.context.restore(seq, data)

    def open_grammar(self, gbnf: str) -> int:
        """A grammar for one lane; GrammarError when the GBNF does not parse."""
        handle = next(self._handles)
        self._grammars[handle] = Grammar(self.context.model, gbnf)
        return handle

    def close_grammar(self, handle: int) -> None:
        grammar = self._grammars.pop(handle, None)
        if grammar is not None:
            grammar.close()

    def embed(self, tokens: list[int]) -> np.ndarray:
        # a context of its own, so this may run beside a step: llama.cpp contexts share only the weights
        with self._embedding:
            if self._embedder is None:
                self._embedder = EmbeddingContext(self.context.model, self.shape.threads, self.shape.window)
            return self._embedder.embed(tokens)

    def open_shaping(self, shaping: Shaping, recent: list[int]) -> int:
        """Bias, penalties and log probabilities for one lane; `recent` is its prompt's tail."""
        handle = next(self._handles)
        self._shapers[handle] = Shaper(shaping, recent, self.end_of_generation)
        return handle

    def close_shaping(self, handle: int) -> None:
        self._shapers.pop(handle, None)

    def open_drafter(self, stream: list[int]) -> int:
        handle = next(self._handles)
        self._drafters[handle] = Drafter(PromptLookup(stream), Acceptance(self.acceptance))
        return handle

    def close_drafter(self, handle: int) -> None:
        self._drafters.pop(handle, None)

    def restart(self) -> None:
        """Nothing to restart in this process: llama.cpp failing here takes the daemon with it."""

    def abandon_restart(self) -> None:
        """Nothing restarts here."""

    def close(self) -> None:
        for handle in list(self._grammars):
            self.close_grammar(handle)
        with self._embedding:
            if self._embedder is not None:
                self._embedder.close()
        self.context.close()


@dataclass(frozen=True)
class Batch:
    """A decode's inputs, and the row of each drawing lane's input (in the lanes' order)."""

    tokens: np.ndarray
    positions: np.ndarray
    seqs: np.ndarray
    want: np.ndarray
    rows: np.ndarray

    @classmethod
    def of_inputs(cls, tokens: list[int], positions: list[int], seqs: list[int]) -> Batch:
        """One input row per lane, each drawing."""
        return cls(
            np.array(tokens, dtype=np.int32),
            np.array(positions, dtype=np.int32),
            np.array(seqs, dtype=np.int32),
            np.ones(len(tokens), dtype=np.int8),
            np.arange(len(tokens)),
        )

    def with_drafts(self, drafts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The decode's arrays with each lane's draft right after its input row, every drafted row wanted."""
        at: list[int] = []
        tokens: list[int] = []
        positions: list[int] = []
        seqs: list[int] = []
        for row, draft in zip(self.rows, drafts, strict=True):
            if draft:
                start = int(self.positions[row]) + 1
                at += [int(row) + 1] * len(draft)
                tokens += draft
                positions += range(start, start + len(draft))
                seqs += [int(self.seqs[row])] * len(draft)
        if not at:
            return self.tokens, self.positions, self.seqs, self.want
        return (
            np.insert(self.tokens, at, tokens),
            np.insert(self.positions, at, positions),
            np.insert(self.seqs, at, seqs),
            np.insert(self.want, at, 1),
        )


def _opened(table: dict[int, T], handle: int, what: str) -> T:
    """The state a handle names; a handle this engine never opened is an error, never "no constraint"."""
    found = table.get(handle)
    if found is None:
        raise EngineError(f"{what} handle {handle} is not open in this engine")
    return found
