"""Per-job sampling extras: logit bias, repetition penalties and log probabilities.

A job that asks for any of them registers a `Shaping` with the engine once, at admission
(as a grammar is opened), and its draws name the handle. The engine keeps a `Shaper` per
handle: it adjusts each row of logits before the sampler sees it and remembers the tokens
drawn, so the penalties follow the reply without the daemon sending its history every step.
Everything here is a pure function of the job's prompt tail and the tokens it drew, so the
same request twice draws the same tokens.

Order, as llama.cpp's server and OpenAI apply them: logit bias (-100 or less bans the token),
then presence and frequency penalties over the tokens drawn so far (OpenAI: a token's logit
loses `count * frequency + presence`), then the repeat penalty over the last 64 tokens of
prompt and reply (llama.cpp: a positive logit is divided by it, a negative one multiplied).
End-of-generation tokens are never penalised: the prompt's own end-of-turn markers must not
keep a reply from ending. Log probabilities are the log-softmax of the row as the model
produced it, before any of this and before temperature.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

REPEAT_WINDOW = 64  # tokens of prompt and reply the repeat penalty looks back over
MAX_TOP_LOGPROBS = 20
BAN = -100.0  # a bias at or below this bans its token outright, as OpenAI documents


@dataclass(frozen=True)
class Shaping:
    """What a job asks of the sampler beyond its `GenParams`."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logprobs: int = -1  # -1: none; 0..20: the drawn token's log probability and this many alternatives

    @property
    def penalises(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repeat_penalty != 1.0)

    @property
    def needed(self) -> bool:
        """Whether this asks the engine for anything at all."""
        return bool(self.logit_bias) or self.penalises or self.logprobs >= 0


@dataclass(frozen=True)
class LogprobRow:
    """One drawn token's log probability and the best alternatives (id, log probability), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Shaper:
    """One job's shaping inside the engine: the tokens it has seen, and what they do to its logits."""

    def __init__(self, shaping: Shaping, recent: list[int], exempt: np.ndarray) -> None:
        self.shaping = shaping
        self.exempt = exempt  # by token id: True for end-of-generation tokens
        self.counts: collections.Counter[int] = collections.Counter()  # tokens drawn in this reply
        self.recent: collections.deque[int] = collections.deque(recent[-REPEAT_WINDOW:], maxlen=REPEAT_WINDOW)
        if shaping.logit_bias:
            self.bias_ids = np.array([t for t, _ in shaping.logit_bias], dtype=np.int64)
            biases = np.array([b for _, b in shaping.logit_bias], dtype=np.float32)
            self.biases = np.where(biases <= BAN, np.float32(-np.inf), biases).astype(np.float32)

    def apply(self, logits: np.ndarray) -> None:
        """Bias and penalise one row of logits, in place."""
        s = self.shaping
        if s.logit_bias:
            logits[self.bias_ids] += self.biases
        if (s.presence_penalty or s.frequency_penalty) and self.counts:
            ids = self._penalised(self.counts)
            counts = np.array([self.counts[t] for t in ids], dtype=np.float32)
            logits[ids] -= counts * np.float32(s.frequency_penalty) + np.float32(s.presence_penalty)
        if s.repeat_penalty != 1.0 and self.recent:
            ids = self._penalised(set(self.recent))
            seen = logits[ids]
            penalty = np.float32(s.repeat_penalty)
            logits[ids] = np.where(seen > 0, seen / penalty, seen * penalty)

    def _penalised(self, tokens: Iterable[int]) -> np.ndarray:
        ids = np.fromiter(sorted(tokens), dtype=np.int64)
        return ids[~self.exempt[ids]]

    def accept(self, token: int) -> None:
        """The job drew `token`: it counts against what comes next."""
        self.counts[token] += 1
        self.recent.append(token)


def log_softmax_row(logits: np.ndarray, token: int, top: int) -> LogprobRow:
    """`token`'s log probability under `logits`, with the `top` most probable tokens (ties to the lower id)."""
    x = np.asarray(logits, dtype=np.float32)
    best = float(x.max())
    # the normaliser is at least the best logit, so no log probability comes out above 0
    norm = np.float32(best + np.log(np.exp((x - best).astype(np.float64)).sum()))
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        top = min(top, x.shape[0])
        threshold = np.partition(x, x.shape[0] - top)[x.shape[0] - top]
        candidates = np.flatnonzero(x >= threshold)
        order = np.lexsort((candidates, -x[candidates]))[:top]
        alternatives = tuple((int(t), float(x[t] - norm)) for t in candidates[order])
    return LogprobRow(token, float(x[token] - norm), alternatives)
