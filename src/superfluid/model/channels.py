"""Generated tokens, split into channel runs with their text.

The splitter watches the decoded text for the model's markers: `<think>`...`</think>`
opens and closes the reasoning channel (1), `<tool_call>`...`</tool_call>` the tool-call
channel (2); everything else is text (0). Markers are matched on text, so they work
whether the vocabulary has them as one special token or spells them out in pieces.
Tokens that might be the start of a marker are held back until it is clear; a marker's
tokens stay in its run's span, its text never reaches a run's text. Text is decoded
incrementally, so a character split across tokens appears once, whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..protocol.schema import CHANNEL_REASONING, CHANNEL_TEXT, CHANNEL_TOOL_CALL


@dataclass(frozen=True)
class Markers:
    """The text that opens and closes one channel."""

    channel: int
    open: str
    close: str


THINK = Markers(CHANNEL_REASONING, "<think>", "</think>")
TOOL_CALL = Markers(CHANNEL_TOOL_CALL, "<tool_call>", "</tool_call>")


@dataclass
class Piece:
    """Tokens and the text they complete, in one channel; `closes` ends that channel's run."""

    channel: int
    tokens: list[int]
    text: str
    closes: bool = False
    call: str | None = None  # on the piece that closes a tool call: the call's whole text


@dataclass
class ChannelSplitter:
    """Classifies a generation's tokens into channels, one token at a time."""

    pieces: Sequence[bytes]
    markers: Sequence[Markers] = (THINK, TOOL_CALL)
    channel: int = CHANNEL_TEXT
    call_text: str = ""  # the open tool call's text so far
    _held_tokens: list[int] = field(default_factory=list)
    _held_text: str = ""
    _replayed: int = 0  # leading characters of _held_text that were committed before (priming)

    def __post_init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def prime(self, tokens: Sequence[int]) -> None:
        """Replay an open turn's tokens, so a continuation starts in the channel it was left in."""
        for token in tokens:
            self.feed(token)
        self._held_tokens = []
        self._replayed = len(self._held_text)

    def feed(self, token: int) -> list[Piece]:
        self._held_tokens.append(token)
        self._held_text += self._decoder.decode(self.pieces[token])
        return self._scan()

    def flush(self) -> list[Piece]:
        """Everything held back, at the end of a generation."""
        self._held_text += self._decoder.decode(b"", final=True)
        out = [self._emit(self._held_tokens, self._held_text)] if self._held_tokens or self._held_text else []
        self._held_tokens, self._held_text, self._replayed = [], "", 0
        return [p for p in out if p.tokens or p.text]

    def _in_play(self) -> list[tuple[str, Markers, bool]]:
        """Marker texts that can occur now: (text, markers, opens)."""
        if self.channel == CHANNEL_TEXT:
            return [(m.open, m, True) for m in self.markers]
        return [(m.close, m, False) for m in self.markers if m.channel == self.channel]

    def _scan(self) -> list[Piece]:
        out: list[Piece] = []
        while True:
            in_play = self._in_play()
            found = min(
                ((self._held_text.find(text), text, m, opens) for text, m, opens in in_play if text in self._held_text),
                default=None,
                key=lambda hit: hit[0],
            )
            if found is None:
                break
            at, text, marker, opens = found
            before = self._held_text[:at]
            after = self._held_text[at + len(text) :]
            if opens:
                if before:
                    out.append(self._emit([], before))
                self.channel = marker.channel
                self.call_text = ""
                out.append(Piece(marker.channel, self._held_tokens, ""))
            else:
                piece = self._emit(self._held_tokens, before, closes=True)
                if marker.channel == CHANNEL_TOOL_CALL:
                    piece.call = self.call_text
                out.append(piece)
                self.channel = CHANNEL_TEXT
            self._held_tokens, self._held_text = [], after
            self._replayed = max(0, self._replayed - at - len(text))
        if not any(_ends_with_prefix(self._held_text, text) for text, _, _ in self._in_play()):
            if self._held_tokens or self._held_text:
                out.append(self._emit(self._held_tokens, self._held_text))
            self._held_tokens, self._held_text, self._replayed = [], "", 0
        return [p for p in out if p.tokens or p.text or p.closes]

    def _emit(self, tokens: list[int], text: str, closes: bool = False) -> Piece:
        fresh = text[self._replayed :]  # text an earlier event already committed is not repeated
        self._replayed = max(0, self._replayed - len(text))
        if self.channel == CHANNEL_TOOL_CALL:
            self.call_text += text
        return Piece(self.channel, tokens, fresh, closes)


def _ends_with_prefix(text: str, marker: str) -> bool:
    """Whether `text` ends with a proper prefix of `marker` (a marker may be starting)."""
    return any(text.endswith(marker[:n]) for n in range(1, len(marker)))
