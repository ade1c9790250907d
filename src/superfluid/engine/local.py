"""The engine as the scheduler drives it: a batch of token ids in, a sampled token per lane out.

A `Step` is one llama_decode: token ids, positions and sequence ids, and for each lane
whose last token it carries, a `Draw` saying how to pick the next token (sampling
parameters, the stream position its random draw is keyed by, whether end-of-generation is
banned, the handles of its grammar and of its `Shaping`, and how long a run it may draw:
a lane whose run is longer than one decodes its drawn token at once, in a batch of the
lanes still running, and draws again, so a few tokens cost one call). `LocalEngine` runs steps in
this process: decode, then sample each wanted row, shaped (bias, penalties) and masked by the
lane's grammar, which then accepts the token; a lane whose shaping asks for log probabilities
gets them back in the step's `logprobs`.
The worker process (`worker.py`) serves the same calls over its channel (`channel.py`), so
the scheduler never knows which one it drives. `embed` pools one input on a second context,
called by the HTTP routes from their own threads, never by the scheduler.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

import numpy as np

from ..protocol.schema import GenParams
from .grammar import Grammar
from .llama import ContextShape, EmbeddingContext, EngineError, KVFull, LlamaContext
from .sampling import sample
from .shaping import LogprobRow, Shaper, Shaping, log_softmax_row

T = TypeVar("T")


class WorkerGone(EngineError):
    """The process that ran the engine died; the text says how (its exit status or signal)."""


@dataclass(frozen=True)
class Draw:
    """How to pick one lane's next token."""

    params: GenParams
    position: int  # the stream position of the token drawn: its random draw is keyed by it
    ignore_eos: bool = False
    grammar: int = 0  # an `open_grammar` handle; 0 for none
    shaping: int = 0  # an `open_shaping` handle; 0 for none
    # tokens it may draw in this call, each decoded before the next; an end of generation stops it (a
    # verified draft's tokens count toward it, and may pass it: they come from one decode)
    run: int = 1
    # the next `verify` draws are rows of the same lane whose inputs are drafted tokens: each draft
    # stands while it equals what the row before it drew, and this draw takes every token drawn so
    # (theirs stay empty); the lane's KV loses the drafts that did not stand
    verify: int = 0


@dataclass
class Step:
    """One decode: a row of logits is wanted where `want` is 1, one `Draw` per such row, in order.

    The engine fills `logprobs` (by draw index) for the draws whose shaping asks for them (a
    draw that asks for them runs one token), and `first_decode_s`, the time of the decode of
    the step's own batch (what the runs after it take is not in it).
    """

    tokens: np.ndarray
    positions: np.ndarray
    seqs: np.ndarray
    want: np.ndarray
    draws: list[Draw]
    logprobs: dict[int, LogprobRow] = field(default_factory=dict)
    first_decode_s: float = 0.0


class Engine(Protocol):
    """What the scheduler needs of llama.cpp: steps, KV slots and grammars.

    Any call may raise `KVFull` (no room for a step or a restore), `EngineError`, or
    `WorkerGone` when the engine runs in a worker that died; `restart` then starts another.
    """

    shape: ContextShape
    end_of_generation: np.ndarray  # by token id: True for the tokens that end a turn

    @property
    def copy_pending(self) -> bool: ...

    def step(self, step: Step) -> list[list[int]]:
        """The tokens each draw drew, in order: one, up to its `run`, or for a draw that verifies
        drafts the drafts that stood and the token after them (its drafted rows' lists are empty)."""
        ...

    def copy(self, source: int, target: int, length: int) -> None: ...

    def truncate(self, seq: int, length: int) -> None: ...

    def export(self, seq: int) -> bytes: ...

    def restore(self, seq: int, data: bytes) -> None: ...

    def open_grammar(self, gbnf: str) -> int: ...

    def close_grammar(self, handle: int) -> None: ...

    def embed(self, tokens: list[int]) -> np.ndarray:
        """The pooled embedding of one input (n_embd float32s), from a context of its own: the lanes'
        KV is untouched. It may be called from another thread than the steps'."""
        ...

    def open_shaping(self, shaping: Shaping, recent: list[int]) -> int: ...

    def close_shaping(self, handle: int) -> None: ...

    def restart(self) -> None: ...

    def abandon_restart(self) -> None: ...

    def close(self) -> None: ...


class LocalEngine:
    """llama.cpp in this process: a context, and the grammars and shapings of the lanes that have one."""

    def __init__(self, context: LlamaContext) -> None:
        self.context = context
        self.shape = context.shape
        self.end_of_generation = context.model.end_of_generation
        self._grammars: dict[int, Grammar] = {}
        self._shapers: dict[int, Shaper] = {}
        self._handles = itertools.count(1)
        self._embedder: EmbeddingContext | None = None  # made on the first embedding asked for
        self._embedding = threading.Lock()  # one embedding at a time: requests come from several threads

    @property
    def copy_pending(self) -> bool:
        return self.context.copy_pending

    def step(self, step: Step) -> list[list[int]]:
        started = time.perf_counter()
        logits = self.context.decode(step.tokens, step.positions, step.seqs, step.want)
        step.first_decode_s = time.perf_counter() - started
        drawn: list[list[int]] = []
        rows = np.flatnonzero(step.want)  # the batch index of each draw's row
        for i, (row, draw) in enumerate(zip(logits, step.draws, strict=True)):
            if len(drawn) > i:
                continue  # a drafted row, verified with its lead
            drawn.append([self._pick(step, i, row, draw)])
            if draw.verify:
                drawn += self._verify(step, i, logits, rows, drawn[i])
        seqs = step.seqs[step.want != 0]
        running = [  # a verified draft may have drawn several already
            i
            for i, d in enumerate(step.draws)
            if d.run > len(drawn[i]) > 0 and not self.end_of_generation[drawn[i][-1]]
        ]
        while running:
            # the same decode the scheduler would send next: each running lane's last token, alone
            tokens = np.array([drawn[i][-1] for i in running], dtype=np.int32)
            positions = np.array([step.draws[i].position + len(drawn[i]) - 1 for i in running], dtype=np.int32)
            try:
                logits = self.context.decode(tokens, positions, seqs[running], np.ones(len(running), dtype=np.int8))
            except KVFull:
                break  # what was drawn stands; the scheduler decodes the last tokens when there is room
            for i, row in zip(running, logits, strict=True):
                draw = step.draws[i]
                drawn[i].append(self._pick(step, i, row, replace(draw, position=draw.position + len(drawn[i]))))
            running = [
                i for i in running if len(drawn[i]) < step.draws[i].run and not self.end_of_generation[drawn[i][-1]]
            ]
        return drawn

    def _verify(self, step: Step, lead: int, logits: np.ndarray, rows: np.ndarray, picks: list[int]) -> list[list[int]]:
        """Take the lead draw's drafts while each equals the token drawn before it, drawing the next
        from its row; cut the drafts that did not stand from the lane's KV. The drafted rows' lists."""
        count = step.draws[lead].verify
        for j in range(1, count + 1):
            drafted = int(step.tokens[rows[lead + j]])
            if picks[-1] != drafted or self.end_of_generation[drafted]:
                break
            picks.append(self._pick(step, lead + j, logits[lead + j], step.draws[lead + j]))
        kept = len(picks) - 1  # drafts that stood
        if kept < count:
            last = rows[lead]
            self.context.truncate(int(step.seqs[last]), int(step.positions[last]) + 1 + kept)
        return [[] for _ in range(count)]

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
            if draw.run > 1:
                raise EngineError("a draw that asks for log probabilities runs one token")
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

    def restore(self, seq: int, data: bytes) -> None:
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


def _opened(table: dict[int, T], handle: int, what: str) -> T:
    """The state a handle names; a handle this engine never opened is an error, never "no constraint"."""
    found = table.get(handle)
    if found is None:
        raise EngineError(f"{what} handle {handle} is not open in this engine")
    return found
