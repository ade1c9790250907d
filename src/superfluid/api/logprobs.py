"""Log probabilities of a reply's tokens, as text the client can line up with the reply.

The engine measures, for each drawn token of the reply's content, its log probability and the
best alternatives (`LogprobRow`, token ids). `LogprobText` gives each token its text: the drawn
tokens are decoded in sequence, so a character split over two tokens appears whole in the
second and the tokens' texts joined are the content. It also holds each token back until
the content that contains it has been let through (a stop string may still cut it), and at
the end keeps only the tokens whose text began before a cut.
"""

from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..engine.shaping import LogprobRow


@dataclass(frozen=True)
class Candidate:
    """A token the model weighed at one position: its text, its bytes and its log probability."""

    token: str
    bytes: bytes
    logprob: float

    def openai(self) -> dict[str, Any]:
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}


@dataclass(frozen=True)
class TokenLogprob:
    """One token of the reply: what was drawn, and the best alternatives, best first."""

    drawn: Candidate
    top: tuple[Candidate, ...]

    def openai(self) -> dict[str, Any]:
        """The `choices[].logprobs.content[]` entry of the OpenAI API."""
        return {**self.drawn.openai(), "top_logprobs": [c.openai() for c in self.top]}


class LogprobText:
    """Turns a reply's `LogprobRow`s into `TokenLogprob`s, released in step with its text."""

    def __init__(self, pieces: Sequence[bytes]) -> None:
        self.pieces = pieces
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._held: deque[tuple[int, TokenLogprob]] = deque()  # (where its text ends, the entry)
        self._measured = 0  # characters of text of every token added
        self._released = 0  # characters of text the reply has let through

    def add(self, rows: Iterable[LogprobRow]) -> None:
        for row in rows:
            raw = self.pieces[row.token]
            text = self._decoder.decode(raw)
            top = tuple(Candidate(self._text(t), self.pieces[t], lp) for t, lp in row.top)
            self._measured += len(text)
            self._held.append((self._measured, TokenLogprob(Candidate(text, raw, row.logprob), top)))

    def _text(self, token: int) -> str:
        return self.pieces[token].decode("utf-8", "replace")

    def release(self, chars: int) -> tuple[TokenLogprob, ...]:
        """The reply let `chars` more characters through: the tokens whose text is now wholly out."""
        self._released += chars
        out = []
        while self._held and self._held[0][0] <= self._released:
            out.append(self._held.popleft()[1])
        return tuple(out)

    def rest(self, cut: bool) -> tuple[TokenLogprob, ...]:
        """At the end of the reply: every token left, or when a stop string cut the text, those begun before it."""
        out = []
        while self._held:
            end, entry = self._held.popleft()
            if cut and end - len(entry.drawn.token) >= self._released:
                break
            out.append(entry)
        self._held.clear()
        return tuple(out)
